"""The inbox claim is one ``INSERT ... ON CONFLICT DO NOTHING`` whose row count is the answer (rule 6).

What the happy path sends to the database is part of the contract here (issue 14: one round trip for
the claim, no read first, one commit per delivery), so these tests record the statements.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.delivery import deliver
from celery_outbox.inbox import dead_letters, ordering
from celery_outbox.inbox import handle as inbox
from celery_outbox.inbox.claim import claim_if_absent
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings
from consumers.effects import duplicates_absorbed
from consumers.models import Shipment
from consumers.shipping import shipping
from consumers.testing import order_placed_envelope
from tests.support.locks import waits_on_a_lock


@contextmanager
def recorded(sessions: sessionmaker[Session]) -> Iterator[list[str]]:
    """Every statement the sessions' engine sends (first word(s) and table), commits as ``COMMIT``."""
    engine = sessions.kw["bind"]
    seen: list[str] = []

    def on_execute(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not statement.upper().startswith("BEGIN"):
            seen.append(" ".join(statement.split()))

    def on_commit(conn: Any) -> None:
        seen.append("COMMIT")

    event.listen(engine, "before_cursor_execute", on_execute)
    event.listen(engine, "commit", on_commit)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", on_execute)
        event.remove(engine, "commit", on_commit)


def kinds(statements: list[str], tables: Tables) -> list[str]:
    """Statements reduced to ``VERB table`` (or ``COMMIT``), for comparing with a budget."""
    names = {tables.table(model).name: short for short, model in (
        ("inbox", tables.inbox), ("parked", tables.parked), ("versions", tables.entity_versions),
        ("counters", tables.counters), ("shipments", Shipment))}
    out = []
    for s in statements:
        if s == "COMMIT":
            out.append(s)
            continue
        verb = s.split()[0].upper()
        # the table written or read is the first one named (a RETURNING may name another one later)
        at = {short: min((i for i in (f" {s} ".find(f" {name} "), s.find(f" {name}(")) if i >= 0), default=-1)
              for name, short in names.items()}
        table = min((short for short, i in at.items() if i >= 0), key=lambda short: at[short], default="?")
        out.append(f"{verb} {table}")
    return out


def count(sessions: sessionmaker[Session], model: Any) -> int:
    with sessions() as s:
        return int(s.execute(sa.select(sa.func.count()).select_from(model)).scalar_one())


def test_duplicate_detected_by_row_count_transaction_still_usable(any_sessions: sessionmaker[Session],
                                                                  clock: ManualClock, tables: Tables) -> None:
    env = order_placed_envelope("o-1")
    # Given the key claimed and committed once
    with any_sessions() as s:
        assert claim_if_absent(s, env, tables=tables, consumer="shipping", now_ms=1) is True
        s.commit()
    # When it is claimed again, Then the answer is False and the transaction is not aborted: it still commits work
    with any_sessions() as s:
        assert claim_if_absent(s, env, tables=tables, consumer="shipping", now_ms=2) is False
        s.add(Shipment(order_id="after-duplicate", address_line="", items=1, created_at_ms=0))
        s.commit()
    with any_sessions() as s:
        assert s.get(tables.inbox, (env.message_id, "shipping")).processed_at_ms == 1  # type: ignore[union-attr]
    assert count(any_sessions, Shipment) == 1
    # And another consumer's claim of the same message is its own key
    with any_sessions() as s:
        assert claim_if_absent(s, env, tables=tables, consumer="billing", now_ms=3) is True


def test_happy_path_is_claim_effect_one_commit_no_read(any_sessions: sessionmaker[Session], clock: ManualClock,
                                                        tables: Tables) -> None:
    env = order_placed_envelope("o-1")
    with any_sessions() as s, recorded(any_sessions) as seen:
        assert inbox.handle(s, env, tables=tables, consumer="shipping", handler=shipping, clock=clock) \
            is Outcome.PROCESSED
    assert kinds(seen, tables) == ["INSERT inbox", "INSERT shipments", "COMMIT"]
    assert "ON CONFLICT" in seen[0].upper()


def test_duplicate_is_one_transaction_with_its_count(any_sessions: sessionmaker[Session], clock: ManualClock,
                                                     tables: Tables) -> None:
    env = order_placed_envelope("o-1")
    with any_sessions() as s:
        inbox.handle(s, env, tables=tables, consumer="shipping", handler=shipping, clock=clock)
    # When the same message comes again: the claim inserts nothing; the duplicate is counted in that transaction
    with any_sessions() as s, recorded(any_sessions) as seen:
        assert inbox.handle(s, env, tables=tables, consumer="shipping", handler=shipping, clock=clock) \
            is Outcome.DUPLICATE
    # (one statement either way; on Postgres the count is a striped increment, a WITH .. UPDATE/INSERT: counters.py)
    counted = "WITH counters" if any_sessions.kw["bind"].dialect.name == "postgresql" else "INSERT counters"
    assert kinds(seen, tables) == ["INSERT inbox", counted, "COMMIT"]
    assert count(any_sessions, Shipment) == 1
    with any_sessions() as s:
        assert duplicates_absorbed(s, tables) == {"shipping": 1}


def test_handler_failure_rolls_back_the_claim(any_sessions: sessionmaker[Session], clock: ManualClock,
                                              tables: Tables) -> None:
    def boom(session: Session, env: Envelope) -> None:
        shipping(session, env)
        session.flush()
        raise RuntimeError("downstream said no")

    env = order_placed_envelope("o-1")
    with any_sessions() as s, pytest.raises(RuntimeError, match="downstream said no"):
        inbox.handle(s, env, tables=tables, consumer="shipping", handler=boom, clock=clock)
    assert count(any_sessions, tables.inbox) == 0
    assert count(any_sessions, Shipment) == 0
    # And the redelivery claims the key afresh and runs the effect once
    with any_sessions() as s:
        assert inbox.handle(s, env, tables=tables, consumer="shipping", handler=shipping, clock=clock) \
            is Outcome.PROCESSED
    assert count(any_sessions, Shipment) == 1


def test_ordered_next_version_statement_budget(any_sessions: sessionmaker[Session], clock: ManualClock,
                                               tables: Tables) -> None:
    def effect(session: Session, env: Envelope) -> None:
        shipping(session, env)

    def run(env: Envelope) -> Outcome:
        with any_sessions() as s:
            return inbox.handle(s, env, tables=tables, consumer="ledger", handler=effect, clock=clock, ordering=True,
                                park_timeout_ms=60_000)

    # Given version 1 of an entity never seen: recorded by the insert of its version row, no read of a version,
    # and no read of its parked messages (there cannot be any: inbox/ordering.py); on Postgres that insert's
    # RETURNING also says whether any of the consumer's parked messages expired, elsewhere one read does
    with recorded(any_sessions) as seen:
        assert run(order_placed_envelope("o-1", version=1)) is Outcome.PROCESSED
    expired_read = [] if any_sessions.kw["bind"].dialect.name == "postgresql" else ["SELECT parked"]
    assert kinds(seen, tables) == ["INSERT inbox", "INSERT versions", *expired_read, "INSERT shipments", "COMMIT"]
    # When the next version arrives with nothing parked
    with recorded(any_sessions) as seen:
        assert run(order_placed_envelope("o-1", version=2)) is Outcome.PROCESSED
    # Then: claim, the version advanced (and locked) in one statement whose RETURNING gives the entity's parked
    # marker (clear: no read of its parked messages) and whether any of the consumer's expired, the effect's ORM
    # writes (flushed before the commit), one commit
    assert kinds(seen, tables) == ["INSERT inbox", "UPDATE versions", "INSERT shipments", "COMMIT"]
    with any_sessions() as s:
        row = s.get(tables.entity_versions, ("ledger", "order:o-1"))
        assert row is not None and (row.version, row.parked) == (2, 0)


def test_ordered_version_with_parked_siblings_reads_and_releases_them(any_sessions: sessionmaker[Session],
                                                                      clock: ManualClock, tables: Tables) -> None:
    applied: list[int] = []

    def run(env: Envelope) -> Outcome:
        with any_sessions() as s:
            return inbox.handle(s, env, tables=tables, consumer="ledger", clock=clock, ordering=True,
                                handler=lambda s, e: applied.append(int(e.headers["entity_version"])),
                                park_timeout_ms=60_000)

    def marker() -> int:
        with any_sessions() as s:
            row = s.get(tables.entity_versions, ("ledger", "order:o-1"))
            assert row is not None
            return row.parked

    # Given versions 1 and 2 applied, then 4 and 6 parked: the deliveries that parked them set the marker
    for version in (1, 2):
        assert run(order_placed_envelope("o-1", version=version)) is Outcome.PROCESSED
    assert marker() == 0
    for version in (4, 6):
        assert run(order_placed_envelope("o-1", version=version)) is Outcome.PARKED
    assert marker() == 1
    # When 3 arrives, Then it reads the parked ones, applies 4, leaves 6 parked and the marker set
    with recorded(any_sessions) as seen:
        assert run(order_placed_envelope("o-1", version=3)) is Outcome.PROCESSED
    assert kinds(seen, tables)[:3] == ["INSERT inbox", "UPDATE versions", "SELECT parked"]
    assert applied == [1, 2, 3, 4] and marker() == 1
    # When 5 arrives, Then 6 is released too and the marker cleared
    assert run(order_placed_envelope("o-1", version=5)) is Outcome.PROCESSED
    assert applied == [1, 2, 3, 4, 5, 6] and marker() == 0
    assert count(any_sessions, tables.parked) == 0
    # And the next version reads nothing parked
    with recorded(any_sessions) as seen:
        assert run(order_placed_envelope("o-1", version=7)) is Outcome.PROCESSED
    assert "SELECT parked" not in kinds(seen, tables) and applied[-1] == 7


def test_a_marker_left_by_an_expired_parked_message_costs_one_read_then_clears(
        any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    applied: list[int] = []

    def run(env: Envelope) -> Outcome:
        with any_sessions() as s:
            return inbox.handle(s, env, tables=tables, consumer="ledger", clock=clock, ordering=True,
                                handler=lambda s, e: applied.append(int(e.headers["entity_version"])),
                                park_timeout_ms=10_000)

    # Given version 3 parked, then dead-lettered by a later delivery once the timeout passed (the expiry does
    # not hold the entity's row, so the marker stays set)
    assert run(order_placed_envelope("o-1", version=1)) is Outcome.PROCESSED
    assert run(order_placed_envelope("o-1", version=3)) is Outcome.PARKED
    clock.advance(10_000)
    assert run(order_placed_envelope("o-2", version=1)) is Outcome.PROCESSED
    assert count(any_sessions, tables.parked) == 0 and count(any_sessions, tables.dead_letters) == 1
    # When version 2 arrives, Then it reads the entity's parked messages once, finds none and clears the marker
    with recorded(any_sessions) as seen:
        assert run(order_placed_envelope("o-1", version=2)) is Outcome.PROCESSED
    assert kinds(seen, tables) == ["INSERT inbox", "UPDATE versions", "SELECT parked", "UPDATE versions",
                                   "COMMIT"]
    with any_sessions() as s:
        row = s.get(tables.entity_versions, ("ledger", "order:o-1"))
        assert row is not None and (row.version, row.parked) == (2, 0)
    assert applied == [1, 1, 2]


def test_parked_message_has_no_inbox_row_and_expires_in_a_later_delivery(any_sessions: sessionmaker[Session],
                                                                         clock: ManualClock, tables: Tables) -> None:
    applied: list[int] = []

    def effect(session: Session, env: Envelope) -> None:
        applied.append(int(env.headers["entity_version"]))

    def run(env: Envelope) -> Outcome:
        with any_sessions() as s:
            return inbox.handle(s, env, tables=tables, consumer="ledger", handler=effect, clock=clock, ordering=True,
                                park_timeout_ms=10_000)

    early = order_placed_envelope("a", version=3)
    assert run(order_placed_envelope("a", version=1)) is Outcome.PROCESSED
    # Given v3 of entity a parked (its claim given back: no inbox row), and parked again as a duplicate
    assert run(early) is Outcome.PARKED
    assert run(early) is Outcome.DUPLICATE
    with any_sessions() as s:
        assert s.get(tables.inbox, (early.message_id, "ledger")) is None
        assert s.get(tables.parked, (early.message_id, "ledger")) is not None
    # When a delivery of another entity comes before the timeout, Then nothing expires
    assert run(order_placed_envelope("b", version=1)) is Outcome.PROCESSED
    assert count(any_sessions, tables.dead_letters) == 0
    # When one comes after it, Then that delivery dead-letters the parked v3 once it has committed its own effect
    clock.advance(10_000)
    assert run(order_placed_envelope("c", version=1)) is Outcome.PROCESSED
    with any_sessions() as s:
        [dl] = dead_letters.list_dead_letters(s, tables=tables, consumer="ledger")
        assert dl.message_id == str(early.message_id) and "waiting for version 2" in dl.last_error
    assert count(any_sessions, tables.parked) == 0
    assert applied == [1, 1, 1]


@pytest.mark.postgres
@pytest.mark.parametrize("first_commits", [True, False], ids=["first-commits", "first-rolls-back"])
def test_concurrent_claim_waits_for_the_first_then_answers(pg_sessions: sessionmaker[Session], tables: Tables,
                                                           first_commits: bool) -> None:
    env = order_placed_envelope("o-1")
    results: list[bool] = []
    errors: list[BaseException] = []
    with pg_sessions() as first:
        # Given a first delivery that claimed the key and has not committed yet
        assert claim_if_absent(first, env, tables=tables, consumer="shipping", now_ms=1) is True

        def second() -> None:
            try:
                with pg_sessions() as s:
                    results.append(claim_if_absent(s, env, tables=tables, consumer="shipping", now_ms=2))
                    s.commit()
            except BaseException as e:  # surfaced below
                errors.append(e)

        thread = threading.Thread(target=second)
        thread.start()
        # When a second delivery claims the same key, Then it waits on the first one's row lock
        assert waits_on_a_lock(pg_sessions, thread) and results == []
        # And once the first ends, it answers from what the first did
        if first_commits:
            first.commit()
        else:
            first.rollback()
    thread.join(timeout=30)
    assert errors == []
    assert results == [not first_commits]
    with pg_sessions() as s:
        row = s.get(tables.inbox, (env.message_id, "shipping"))
        assert row is not None and row.processed_at_ms == (1 if first_commits else 2)


def test_a_failed_expiry_after_the_commit_does_not_fail_the_delivery(sqlite_sessions: sessionmaker[Session],
                                                                     clock: ManualClock, tables: Tables,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def run(env: Envelope) -> Outcome:
        with sqlite_sessions() as s:
            return inbox.handle(s, env, tables=tables, consumer="ledger", handler=shipping, clock=clock, ordering=True,
                                park_timeout_ms=1)

    assert run(order_placed_envelope("a", version=1)) is Outcome.PROCESSED
    assert run(order_placed_envelope("a", version=3)) is Outcome.PARKED
    clock.advance(10)

    def moved_meanwhile(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("another delivery dead-lettered or applied that parked row first")

    monkeypatch.setattr(ordering, "expire_parked", moved_meanwhile)
    # When the delivery that found the expired row cannot move it, Then its own effect still stands and is acked
    env = order_placed_envelope("b", version=1)
    assert run(env) is Outcome.PROCESSED
    with sqlite_sessions() as s:
        assert s.get(tables.inbox, (env.message_id, "ledger")) is not None
    assert count(sqlite_sessions, Shipment) == 2


def test_a_counted_redelivery_that_succeeds_reports_its_count_and_clears_it(any_sessions: sessionmaker[Session],
                                                                            clock: ManualClock,
                                                                            tables: Tables) -> None:
    env = order_placed_envelope("o-1")
    # Given a delivery redelivered by the broker (its worker was lost): counted at its start, on one connection
    result = deliver(any_sessions, shipping, json.dumps(env.to_dict()), tables=tables, request_id=None,
                     settings=Settings(), clock=clock, first_delivery=True, redelivered=True)
    # Then it is processed, reports both deliveries, and leaves no count behind
    assert (result.outcome, result.deliveries) == (Outcome.PROCESSED, 2)
    assert count(any_sessions, tables.attempts) == 0
    assert count(any_sessions, Shipment) == 1


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_every_postgres_driver_tells_a_first_delivery_from_a_duplicate(pg_url: str, driver: str, clock: ManualClock,
                                                                        tables: Tables) -> None:
    # Given the same database through psycopg2 and through psycopg 3 (which reports -1 for an INSERT's row
    # count unless asked: every claim read as a duplicate would skip every effect, silently)
    from celery_outbox.db import make_engine, make_session_factory

    url = pg_url.replace("postgresql://", f"postgresql+{driver}://", 1)
    engine = make_engine(url)
    sessions = make_session_factory(engine)
    env = order_placed_envelope(f"o-{driver}")
    try:
        # When a message is handled twice, and versions of an entity are claimed in turn
        with sessions() as s:
            first = inbox.handle(s, env, tables=tables, consumer="shipping", handler=shipping, clock=clock)
        with sessions() as s:
            second = inbox.handle(s, env, tables=tables, consumer="shipping", handler=shipping, clock=clock)
        with sessions() as s:
            started = ordering._create(s, "search", f"order:{driver}", tables=tables, cutoff_ms=0)
            again = ordering._create(s, "search", f"order:{driver}", tables=tables, cutoff_ms=None)
            advanced = ordering._advance(s, "search", f"order:{driver}", 2, tables=tables, cutoff_ms=0)
            next_one = ordering._lock_entity(s, "search", f"order:{driver}", 3, tables=tables)
            early = ordering._lock_entity(s, "search", f"order:{driver}", 4, tables=tables)
            s.commit()
        # Then the first is processed with its effect, the second a duplicate, the first version creates the
        # entity's row (nothing expired) and its second insert does not, the second version advances it (the
        # entity's parked marker clear, nothing expired); the lock a third version takes leaves the marker clear,
        # the one a fourth takes (it will park) sets it
        assert (first, second) == (Outcome.PROCESSED, Outcome.DUPLICATE)
        assert (started, again, advanced) == ((True, False), (False, False), (False, False))
        assert (next_one, early) == ((2, False), (2, True))
        with sessions() as s:
            assert s.scalar(sa.select(sa.func.count()).select_from(Shipment)
                            .where(Shipment.order_id == f"o-{driver}")) == 1
    finally:
        engine.dispose()


def test_a_counted_delivery_is_one_upsert_and_its_commit_before_the_work(any_sessions: sessionmaker[Session],
                                                                         tables: Tables) -> None:
    from celery_outbox.inbox import attempts

    mid = order_placed_envelope("o-1").message_id
    # Given a message whose worker died once without a row (``uncounted``)
    with any_sessions() as s, recorded(any_sessions) as seen:
        # When its redelivery is counted, and then a later one
        first = attempts.begin(s, tables=tables, key=mid, consumer="shipping", now_ms=5, uncounted=1)
        assert (first.deliveries, first.first_failed_at_ms, first.last_error) == (2, 5, "")
        second = attempts.begin(s, tables=tables, key=mid, consumer="shipping", now_ms=9)
        assert second.deliveries == 3
    # Then each count is ONE statement (the upsert returns the row) and a commit, no read after it
    counted = [k for k in seen if k == "COMMIT" or k.startswith("INSERT")]
    assert len(seen) == 4 and len(counted) == 4 and seen[1] == seen[3] == "COMMIT"
    assert all("RETURNING" in k.upper() for k in (seen[0], seen[2]))
    # And the count is committed: another session reads it
    with any_sessions() as s:
        assert s.execute(sa.select(tables.attempts.deliveries).where(
            tables.attempts.message_id == mid)).scalar_one() == 3


@pytest.mark.postgres
def test_driver_sql_only_where_the_text_is_what_sqlalchemy_would_send(pg_url: str, sqlite_engine: sa.Engine) -> None:
    from sqlalchemy.pool import NullPool

    from celery_outbox.db import make_engine
    from celery_outbox.inbox.claim import driver_sql

    def build() -> Any:
        return sa.select(sa.literal_column("1"))

    pooled, unpooled = make_engine(pg_url), sa.create_engine(pg_url, poolclass=NullPool)
    try:
        # Given a pooled libpq connection, Then the text is compiled once and kept on the connection
        with pooled.connect() as c:
            assert driver_sql(c, ("t",), build) == "SELECT 1"
            assert driver_sql(c, ("t",), lambda: pytest.fail("compiled twice")) == "SELECT 1"
            # But not under a schema_translate_map (SQLAlchemy rewrites the statement as it runs it)
            assert driver_sql(c.execution_options(schema_translate_map={None: "other"}), ("u",), build) is None
        # Nor on a connection that does not outlive its checkout, nor on SQLite
        with unpooled.connect() as c:
            assert driver_sql(c, ("t",), build) is None
        with sqlite_engine.connect() as c:
            assert driver_sql(c, ("t",), build) is None
    finally:
        pooled.dispose()
        unpooled.dispose()
