"""Per-entity ordering (rule 10): stale versions skipped, early ones parked until the gap fills."""

from __future__ import annotations

import threading
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.errors import MalformedMessageError
from celery_outbox.inbox import dead_letters, ordering
from celery_outbox.inbox import handle as inbox
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from consumers.models import SearchDocument
from consumers.search import search_in_order as search_consumer
from consumers.testing import order_placed_envelope
from tests.support.locks import waits_on_a_lock


class Recorder:
    def __init__(self) -> None:
        self.applied: list[int] = []

    def __call__(self, session: Session, env: Envelope) -> None:
        self.applied.append(int(env.headers["entity_version"]))


def v(n: int, *, order_id: str = "o-1") -> Envelope:
    return order_placed_envelope(order_id, version=n, total_cents=n * 100)


def run(sessions: sessionmaker[Session], tables: Tables, env: Envelope, clock: ManualClock, handler: Recorder) -> Outcome:
    with sessions() as s:
        return inbox.handle(s, env, tables=tables, consumer="ledger", handler=handler, clock=clock, ordering=True)


def test_in_order_early_and_stale(any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    rec = Recorder()
    v1, v2, v3, v4 = v(1), v(2), v(3), v(4)
    # Given v1 applied
    assert run(any_sessions, tables, v1, clock, rec) is Outcome.PROCESSED
    # When v3 and v4 arrive before v2, Then they are parked, not applied
    assert run(any_sessions, tables, v4, clock, rec) is Outcome.PARKED
    assert run(any_sessions, tables, v3, clock, rec) is Outcome.PARKED
    assert run(any_sessions, tables, v3, clock, rec) is Outcome.DUPLICATE  # a redelivery of a parked one
    assert rec.applied == [1]
    # When v2 fills the gap, Then v2, v3, v4 are applied in order in the same transaction
    assert run(any_sessions, tables, v2, clock, rec) is Outcome.PROCESSED
    assert rec.applied == [1, 2, 3, 4]
    with any_sessions() as s:
        assert s.execute(sa.select(sa.func.count()).select_from(tables.parked)).scalar_one() == 0
        assert s.get(tables.entity_versions, ("ledger", "order:o-1")).version == 4  # type: ignore[union-attr]
        assert s.execute(sa.select(sa.func.count()).select_from(tables.inbox)).scalar_one() == 4
    # When an older version arrives under a new message id, Then it is STALE: skipped, recorded
    assert run(any_sessions, tables, v(2), clock, rec) is Outcome.STALE
    assert rec.applied == [1, 2, 3, 4]
    # And the redelivery of an applied one is a DUPLICATE
    assert run(any_sessions, tables, v4, clock, rec) is Outcome.DUPLICATE


def test_version_one_after_later_versions_were_parked_releases_them(any_sessions: sessionmaker[Session],
                                                                    clock: ManualClock, tables: Tables) -> None:
    rec = Recorder()
    # Given v3 and v2 of an entity never seen parked (their deliveries created its row, at version 0)
    assert run(any_sessions, tables, v(3), clock, rec) is Outcome.PARKED
    assert run(any_sessions, tables, v(2), clock, rec) is Outcome.PARKED
    # When v1 arrives, Then its insert of the entity's row finds the row: it reads the parked ones and applies
    # all three in order (only an insert that creates the row may skip that read: inbox/ordering.py)
    assert run(any_sessions, tables, v(1), clock, rec) is Outcome.PROCESSED
    assert rec.applied == [1, 2, 3]
    with any_sessions() as s:
        assert s.execute(sa.select(sa.func.count()).select_from(tables.parked)).scalar_one() == 0
        assert s.get(tables.entity_versions, ("ledger", "order:o-1")).version == 3  # type: ignore[union-attr]


@pytest.mark.postgres
def test_version_one_waits_for_a_concurrent_delivery_parking_version_two(pg_sessions: sessionmaker[Session],
                                                                         clock: ManualClock, tables: Tables) -> None:
    rec = Recorder()
    results: list[Outcome] = []
    errors: list[BaseException] = []

    def version_one() -> None:
        try:
            with pg_sessions() as s:
                results.append(inbox.handle(s, v(1), tables=tables, consumer="ledger", handler=rec, clock=clock,
                                            ordering=True))
        except BaseException as e:  # surfaced below
            errors.append(e)

    with pg_sessions() as parking:
        # Given v2 of an entity never seen parked by a delivery that has not committed yet (it created the row)
        outcome, _ = ordering.apply(parking, v(2), tables=tables, consumer="ledger", handler=rec,
                                    now_ms=clock.now_ms())
        assert outcome is Outcome.PARKED
        thread = threading.Thread(target=version_one)
        thread.start()
        # When v1 arrives meanwhile, Then its insert of the entity's row waits on that delivery's row lock
        assert waits_on_a_lock(pg_sessions, thread) and results == []
        parking.commit()
    # And once it committed, v1 finds the row (it did not create it), reads the parked v2 and applies both in order
    thread.join(timeout=30)
    assert errors == []
    assert results == [Outcome.PROCESSED]
    assert rec.applied == [1, 2]


@pytest.mark.postgres
def test_the_next_version_waits_for_a_concurrent_delivery_parking_its_successor(pg_sessions: sessionmaker[Session],
                                                                                clock: ManualClock,
                                                                                tables: Tables) -> None:
    rec = Recorder()
    results: list[Outcome] = []
    errors: list[BaseException] = []
    # Given v1 applied: the entity's row says it has no parked message
    assert run(pg_sessions, tables, v(1), clock, rec) is Outcome.PROCESSED

    def version_two() -> None:
        try:
            with pg_sessions() as s:
                results.append(inbox.handle(s, v(2), tables=tables, consumer="ledger", handler=rec, clock=clock,
                                            ordering=True))
        except BaseException as e:  # surfaced below
            errors.append(e)

    with pg_sessions() as parking:
        # And v3 parked by a delivery that has not committed yet (it holds the entity's row and set its marker)
        outcome, _ = ordering.apply(parking, v(3), tables=tables, consumer="ledger", handler=rec,
                                    now_ms=clock.now_ms())
        assert outcome is Outcome.PARKED
        thread = threading.Thread(target=version_two)
        thread.start()
        # When v2 arrives meanwhile, Then its advance of the entity's row waits on that delivery's row lock
        assert waits_on_a_lock(pg_sessions, thread) and results == []
        parking.commit()
    # And once it committed, the advance returns the committed marker (not its snapshot's): v2 reads the parked
    # v3 and applies both in order
    thread.join(timeout=30)
    assert errors == []
    assert results == [Outcome.PROCESSED]
    assert rec.applied == [1, 2, 3]
    with pg_sessions() as s:
        row = s.get(tables.entity_versions, ("ledger", "order:o-1"))
        assert row is not None and (row.version, row.parked) == (3, 0)


def test_entities_are_independent_and_unordered_events_pass(sqlite_sessions: sessionmaker[Session],
                                                            clock: ManualClock, tables: Tables) -> None:
    rec = Recorder()
    assert run(sqlite_sessions, tables, v(1, order_id="a"), clock, rec) is Outcome.PROCESSED
    assert run(sqlite_sessions, tables, v(1, order_id="b"), clock, rec) is Outcome.PROCESSED
    assert run(sqlite_sessions, tables, v(3, order_id="a"), clock, rec) is Outcome.PARKED
    assert run(sqlite_sessions, tables, v(2, order_id="b"), clock, rec) is Outcome.PROCESSED
    no_headers = order_placed_envelope("c", version=None)
    with sqlite_sessions() as s:
        assert inbox.handle(s, no_headers, tables=tables, consumer="ledger", handler=lambda s, e: None, clock=clock,
                            ordering=True) is Outcome.PROCESSED


def test_parked_message_dead_lettered_after_timeout_then_replayable(sqlite_sessions: sessionmaker[Session],
                                                                    clock: ManualClock, tables: Tables) -> None:
    rec = Recorder()
    v3 = v(3)
    assert run(sqlite_sessions, tables, v(1), clock, rec) is Outcome.PROCESSED
    assert run(sqlite_sessions, tables, v3, clock, rec) is Outcome.PARKED
    # Given the gap (v2) never fills within the timeout
    clock.advance(5_000)
    with sqlite_sessions() as s:
        assert ordering.expire_parked(s, tables=tables, consumer="ledger", now_ms=clock.now_ms(), timeout_ms=10_000) == 0
    clock.advance(5_000)
    # When the timeout passes, Then the parked message is dead-lettered with a clear error
    with sqlite_sessions() as s:
        assert ordering.expire_parked(s, tables=tables, consumer="ledger", now_ms=clock.now_ms(), timeout_ms=10_000) == 1
        [dl] = dead_letters.list_dead_letters(s, tables=tables, consumer="ledger")
        assert dl.message_id == str(v3.message_id) and dl.type == "OrderPlaced"
        assert "waiting for version 2" in dl.last_error and "version 3" in dl.last_error
        assert s.execute(sa.select(sa.func.count()).select_from(tables.parked)).scalar_one() == 0
        dl_id = dl.id
    # When v2 arrives later and the dead letter is replayed, Then v3 goes through the same path
    assert run(sqlite_sessions, tables, v(2), clock, rec) is Outcome.PROCESSED
    sent: list[tuple[str, dict[str, object]]] = []
    with sqlite_sessions() as s:
        dead_letters.replay(s, dl_id, tables=tables, send=lambda c, e: sent.append((c, e)), clock=clock)
    [(consumer, body)] = sent
    assert consumer == "ledger"
    assert run(sqlite_sessions, tables, Envelope.from_dict(body), clock, rec) is Outcome.PROCESSED
    assert rec.applied == [1, 2, 3]


def test_the_ordered_search_consumer_keeps_the_newest_document(any_sessions: sessionmaker[Session], clock: ManualClock,
                                                   tables: Tables) -> None:
    search = search_consumer
    assert search.ordering
    with any_sessions() as s:
        assert search.handle(s, order_placed_envelope("o-1", version=1, total_cents=100), tables=tables, clock=clock) \
            is Outcome.PROCESSED
        assert search.handle(s, order_placed_envelope("o-1", version=3, total_cents=300), tables=tables, clock=clock) \
            is Outcome.PARKED
        assert search.handle(s, order_placed_envelope("o-1", version=2, total_cents=200), tables=tables, clock=clock) \
            is Outcome.PROCESSED
        assert search.handle(s, order_placed_envelope("o-1", version=2, total_cents=999), tables=tables, clock=clock) \
            is Outcome.STALE
        doc = s.get(SearchDocument, "o-1", populate_existing=True)
        assert doc is not None and (doc.version, doc.body["total_cents"]) == (3, 300)


@pytest.mark.parametrize("headers", [{"entity_key": "k"}, {"entity_key": "", "entity_version": 1},
                                     {"entity_key": "k", "entity_version": True}])
def test_incomplete_ordering_headers_are_a_malformed_message(headers: dict[str, object]) -> None:
    env = Envelope(message_id=uuid.uuid4(), type="T", payload={}, headers=headers)
    with pytest.raises(MalformedMessageError, match="entity_"):
        ordering.entity_of(env)


def test_no_ordering_headers_mean_no_ordering() -> None:
    assert ordering.entity_of(Envelope(message_id=uuid.uuid4(), type="T", payload={}, headers={})) is None
