"""The Postgres claim that stamps its rows published as it claims them (``queries.claim_mark_pg``, issue #38):
nothing it does is visible before the COMMIT that follows the broker's confirm, and every outcome of a batch
(published, rejected, dead-lettered, held, broker unavailable, a crash, a late confirm) leaves the same rows,
counters and next due time as the claim that marks its rows after the confirm."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables, counters, workers
from celery_outbox.clock import ManualClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.messages import TASK_KIND, TaskMessage
from celery_outbox.relay.dispatch import (
    STAMP_SLACK_MS,
    BatchResult,
    DeployHold,
    RelayConfig,
    claim_batch,
    claim_due,
    finish_batch,
    send_claimed,
)
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.relay.queries import RelayStatements
from celery_outbox.testing.memory import InMemoryPublisher, PublisherCrashed
from celeryconfig import Settings
from tests.outbox_rows import insert_pending

pytestmark = pytest.mark.postgres

QUEUE = "sc.tasks"
ROUTES = {"OrderPlaced": ("shipping", "billing")}


def task_headers(mid: uuid.UUID) -> dict[str, object]:
    return {"outbox_kind": TASK_KIND, "routing_key": QUEUE, "exchange": "",
            "task_headers": {"task": "t.send", "id": str(mid)}}


def config(engine: sa.Engine, tables: Tables, **kw: Any) -> RelayConfig:
    return RelayConfig(tables=tables, routes=ROUTES, max_message_bytes=1 << 20, max_attempts=3, base_delay_ms=1_000,
                       max_delay_ms=60_000, statements=RelayStatements.build(tables, engine.dialect), **kw)


def batch(sessions: sessionmaker[Session], publisher: InMemoryPublisher, clock: ManualClock, cfg: RelayConfig, *,
          stamp: bool) -> BatchResult:
    """One batch through the relay's three steps, claimed with or without its stamp."""
    session = sessions()
    try:
        claimed = claim_batch(session, clock, cfg, limit=100, stamp=stamp)
        flight = send_claimed(claimed, publisher, clock, cfg)
        return flight if isinstance(flight, BatchResult) else finish_batch(flight, clock, cfg)
    finally:
        session.close()


def state(sessions: sessionmaker[Session], tables: Tables) -> tuple[list[tuple[Any, ...]], dict[str, int]]:
    """Every outbox row (in seq order, without its ids) and every counter, stripes added up."""
    o = tables.outbox
    with sessions() as s:
        rows = [tuple(r) for r in s.execute(
            sa.select(o.type, o.published_at_ms, o.attempts, o.next_attempt_at_ms, o.dead_lettered_at_ms,
                      o.last_error, o.held_for).order_by(o.seq))]
        found = counters.fold(s.execute(sa.select(tables.counters.consumer, tables.counters.name,
                                                  tables.counters.value)).all())
    return rows, found.get(counters.RELAY, {})


def reset(sessions: sessionmaker[Session], tables: Tables) -> None:
    with sessions() as s:
        for table in (tables.outbox, tables.counters, tables.workers):
            s.execute(sa.delete(table))
        s.commit()


def outcome(result: BatchResult) -> tuple[Any, ...]:
    return (result.claimed, result.published, result.failed, result.dead_lettered, result.held,
            result.messages_sent, result.broker_unavailable, result.already_published, result.next_due_ms,
            result.next_due_read, sorted(why for _, why in result.dead_lettered_rows))


Scenario = Callable[[sessionmaker[Session], Tables, ManualClock], InMemoryPublisher]


def mixed(sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> InMemoryPublisher:
    """Published events, one rejected for the first time, one rejected for the last, one with no route,
    a task no live worker runs (held) and one due in 30 s."""
    now = clock.now_ms()
    with sessions() as s:
        workers.register(s, worker=uuid.uuid4(), name="w@h", queues=[QUEUE], tasks={"t.other": 1}, now_ms=now,
                         tables=tables)
    insert_pending(sessions, now, 2, tables=tables)
    [first] = insert_pending(sessions, now, 1, tables=tables)
    [last] = insert_pending(sessions, now, 1, tables=tables)
    insert_pending(sessions, now, 1, tables=tables, type_="NoRoute")
    insert_pending(sessions, now, 1, tables=tables, type_="t.send", headers=task_headers,
                   payload=lambda i, mid: {"body": [[], {}, None]})
    insert_pending(sessions, now + 30_000, 1, tables=tables)
    with sessions() as s:
        s.execute(sa.update(tables.outbox).where(tables.outbox.message_id == last).values(attempts=2))
        s.commit()
    publisher = InMemoryPublisher()
    publisher.reject(first, error="mandatory: no route")
    publisher.reject(last, error="mandatory: no route")
    return publisher


def unavailable(sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> InMemoryPublisher:
    insert_pending(sessions, clock.now_ms(), 3, tables=tables)
    publisher = InMemoryPublisher()
    publisher.fail_unavailable()
    return publisher


def crash(sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> InMemoryPublisher:
    """The relay dies after the broker took the batch (before its confirm is read)."""
    insert_pending(sessions, clock.now_ms(), 3, tables=tables)
    publisher = InMemoryPublisher()
    publisher.crash_after_delivery()
    return publisher


def late(sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> InMemoryPublisher:
    """A batch the broker confirms ``STAMP_SLACK_MS`` + 1 ms after its claim."""
    insert_pending(sessions, clock.now_ms(), 3, tables=tables)
    return InMemoryPublisher(before_publish=lambda _messages: clock.advance(STAMP_SLACK_MS + 1))


@pytest.mark.parametrize("scenario", [mixed, unavailable, crash, late], ids=lambda f: f.__name__)
def test_every_outcome_of_a_batch_stamped_at_its_claim_is_the_outcome_of_one_marked_after_its_confirm(
        pg_engine: sa.Engine, pg_sessions: sessionmaker[Session], tables: Tables, scenario: Scenario) -> None:
    seen: dict[bool, tuple[Any, ...]] = {}
    for stamp in (False, True):
        # Given the same rows, the same broker behaviour and the same clock
        reset(pg_sessions, tables)
        clock = ManualClock(start_ms=1_000_000)
        publisher = scenario(pg_sessions, tables, clock)
        cfg = config(pg_engine, tables, hold=DeployHold(heartbeat_ms=60_000, recheck_ms=5_000))
        # When one batch is claimed (stamped at its claim, or not), published and finished
        try:
            result: tuple[Any, ...] = outcome(batch(pg_sessions, publisher, clock, cfg, stamp=stamp))
        except PublisherCrashed:
            result = ("crashed",)
        with pg_sessions() as s:  # what the broker got, by the rows' places in seq order
            place = {str(m): i for i, m in enumerate(s.scalars(sa.select(tables.outbox.message_id)
                                                               .order_by(tables.outbox.seq)))}
        seen[stamp] = (result, state(pg_sessions, tables), sorted(place[m.message_id] for m in publisher.messages()))
    # Then the rows, the counters, the batch's result and what the broker got are the same
    assert seen[True] == seen[False]
    # (and the scenario did what it says: a look at the rows stamped at the claim)
    result, (rows, found), _sent = seen[True]
    if scenario is mixed:
        assert result[:6] == (6, 2, 1, 2, 1, 4) and result[8] == 1_000_000 + 1_000  # the first rejection's backoff
        assert found.get(counters.PUBLISHED) == 2 and [r[1] for r in rows].count(None) == 5
    elif scenario is late:
        assert {r[1] for r in rows} == {1_000_000 + STAMP_SLACK_MS + 1}  # stamped again at the confirm
    else:
        assert {r[1] for r in rows} == {None} and counters.PUBLISHED not in found and {r[2] for r in rows} == {0}


def test_a_batch_confirmed_within_the_slack_keeps_its_claim_time_and_runs_no_statement_after_the_publish(
        pg_engine: sa.Engine, pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given three due rows and a broker that confirms STAMP_SLACK_MS after the claim
    clock = ManualClock(start_ms=2_000_000)
    insert_pending(pg_sessions, clock.now_ms(), 3, tables=tables)
    insert_pending(pg_sessions, clock.now_ms() + 9_000, 1, tables=tables)
    statements: list[str] = []

    def confirm_within_slack(_messages: Sequence[TaskMessage]) -> None:
        clock.advance(STAMP_SLACK_MS)
        statements.clear()

    publisher = InMemoryPublisher(before_publish=confirm_within_slack)

    def record(_c: object, _cur: object, sql: str, *_: object) -> None:
        statements.append(sql)

    # When one batch is stamped at its claim, published and finished
    sa.event.listen(pg_engine, "before_cursor_execute", record)
    try:
        result = batch(pg_sessions, publisher, clock, config(pg_engine, tables), stamp=True)
    finally:
        sa.event.remove(pg_engine, "before_cursor_execute", record)
    # Then its rows carry the claim's time, counted once, nothing ran after the publish but the COMMIT,
    # and the claim read the next due time
    assert statements == []
    rows, found = state(pg_sessions, tables)
    assert [r[1] for r in rows] == [2_000_000] * 3 + [None]
    assert found == {counters.PUBLISHED: 3}
    assert (result.published, result.next_due_ms, result.next_due_read) == (3, 2_009_000, True)


def test_nothing_a_stamped_claim_did_is_visible_before_the_commit_that_follows_the_confirm(
        pg_engine: sa.Engine, pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given two due rows and a broker that, as it takes the batch, looks at the outbox from another session
    clock = ManualClock(start_ms=3_000_000)
    insert_pending(pg_sessions, clock.now_ms(), 2, tables=tables)
    during: list[tuple[list[tuple[Any, ...]], dict[str, int], int]] = []

    def look(_messages: Sequence[TaskMessage]) -> None:
        rows, found = state(pg_sessions, tables)
        with pg_sessions() as other:  # another relay's claim passes over the locked rows
            taken = len(claim_due(other, clock.now_ms(), 10, tables=tables, statements=cfg.statements))
            other.rollback()
        during.append((rows, found, taken))

    cfg = config(pg_engine, tables)
    # When a batch is stamped at its claim and published
    batch(pg_sessions, InMemoryPublisher(before_publish=look), clock, cfg, stamp=True)
    # Then while the broker had it the rows were pending, uncounted, and locked
    [(rows, found, taken)] = during
    assert [r[1] for r in rows] == [None, None] and found == {} and taken == 0
    # And after the commit they are published, counted once
    rows, found = state(pg_sessions, tables)
    assert [r[1] for r in rows] == [3_000_000] * 2 and found == {counters.PUBLISHED: 2}


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_the_stamped_claim_returns_the_rows_and_types_the_claim_returns(pg_url: str, tables: Tables,
                                                                        driver: str) -> None:
    engine = make_engine(pg_url.replace("postgresql://", f"postgresql+{driver}://", 1))
    sessions = make_session_factory(engine)
    try:
        # Given pending rows with JSON payloads and headers, in an order that is not seq order
        insert_pending(sessions, 5_000, 3, tables=tables, payload=lambda i, mid: {"n": i, "x": [1.5, None, {"é": 1}]},
                       headers=lambda mid: {"trace": str(mid)})
        insert_pending(sessions, 4_000, 2, tables=tables)
        cfg = config(engine, tables)
        with sessions() as s:
            plain = claim_due(s, 10**15, 100, tables=tables, statements=cfg.statements)
            s.rollback()
        # When the stamped claim takes them
        with sessions() as s:
            claimed = claim_batch(s, ManualClock(start_ms=10**12), cfg, limit=100)
            s.rollback()
        # Then the same rows, in the same order (due time, then seq), with the same Python types
        assert claimed.rows == plain and len(plain) == 5
        assert [r.created_at_ms for r in plain] == [4_000, 4_000, 5_000, 5_000, 5_000]
        assert all(isinstance(r.message_id, uuid.UUID) and isinstance(r.payload, dict) for r in claimed.rows)
        assert claimed.stamped_at_ms == 10**12 and claimed.stripe is not None
    finally:
        engine.dispose()


def test_a_schema_translate_map_or_a_claim_with_a_batch_in_flight_is_marked_after_its_confirm(
        pg_engine: sa.Engine, pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    cfg = config(pg_engine, tables)
    insert_pending(pg_sessions, 1_000, 1, tables=tables)
    # Given a relay engine that maps the tables' schema (compiled text would not see the map)
    mapped = make_session_factory(pg_engine.execution_options(schema_translate_map={None: "public"}))
    for sessions, stamp in ((mapped, True), (pg_sessions, False)):
        # When it claims
        with sessions() as s:
            claimed = claim_batch(s, ManualClock(start_ms=2_000), cfg, limit=10, stamp=stamp)
            s.rollback()
        # Then it claimed without stamping: its rows are marked after their confirm
        assert len(claimed.rows) == 1 and claimed.stamped_at_ms is None


def test_the_pipelined_relay_stamps_a_drains_first_batch_at_its_claim_and_marks_the_next_after_its_confirm(
        pg_sessions: sessionmaker[Session], pg_url: str, tmp_path: Any, tables: Tables) -> None:
    # Given four due rows and a relay of batches of two whose broker takes 10 ms per batch
    clock = ManualClock(start_ms=4_000_000)
    insert_pending(pg_sessions, clock.now_ms(), 4, tables=tables)
    publisher = InMemoryPublisher(before_publish=lambda _m: clock.advance(10))
    settings = Settings(home=tmp_path, database_url=pg_url, namespace="sc", routes={"OrderPlaced": ("shipping",)},
                        relay_poll_interval_s=0.05)
    loop = RelayLoop(settings=settings, tables=tables, session_factory=pg_sessions, publisher=publisher, clock=clock,
                     listen=False, batch_size=2)
    # When it drains: batch 1 claimed and sent, batch 2 claimed while batch 1 is in flight
    total = loop.drain_once()
    loop.close()
    # Then batch 1 carries its claim's time, batch 2 (sent only after batch 1 was done) its confirm's
    rows, found = state(pg_sessions, tables)
    assert [r[1] for r in rows] == [4_000_000, 4_000_000, 4_000_020, 4_000_020]
    assert (total.published, found, publisher.duplicates()) == (4, {counters.PUBLISHED: 4}, 0)
    # And the drain's next due time is the last mark's (nothing pending)
    assert (total.next_due_read, total.next_due_ms) == (True, None)


def test_a_stamped_claim_counts_on_a_stripe_of_its_own_while_another_transaction_holds_one(
        pg_engine: sa.Engine, pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    cfg = config(pg_engine, tables)
    insert_pending(pg_sessions, 1_000, 2, tables=tables)
    with pg_sessions() as s:
        counters.increment(s, counters.RELAY, counters.PUBLISHED, 5, tables=tables)
    with pg_sessions() as first, pg_sessions() as second:
        # Given a stamped claim in flight (holding the counter's row)
        a = claim_batch(first, ManualClock(start_ms=2_000), cfg, limit=1)
        # When a second relay's stamped claim takes the other row
        b = claim_batch(second, ManualClock(start_ms=2_000), cfg, limit=1)
        # Then it counted on another row, without waiting, and each gives its rows back from its own row
        assert len(a.rows) == len(b.rows) == 1 and a.stripe != b.stripe
        first.commit()
        second.rollback()
    _rows, found = state(pg_sessions, tables)
    assert found == {counters.PUBLISHED: 5 + 1}
