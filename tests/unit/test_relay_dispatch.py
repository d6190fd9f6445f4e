"""dispatch_batch on SQLite with the in-memory publisher: order, fan-out, one UPDATE, dead letters."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.relay.dispatch import BatchResult, dispatch_batch
from celery_outbox.schema import OutboxRow, Tables
from celery_outbox.testing.memory import InMemoryPublisher
from tests.outbox_rows import insert_pending

ROUTES = {"OrderPlaced": ("shipping", "billing", "search", "email")}
NS = "tns"


def insert(sessions: sessionmaker[Session], clock: ManualClock, tables: Tables, n: int = 1, *,
           type_: str = "OrderPlaced", payload: Any = None) -> list[uuid.UUID]:
    def body(i: int, mid: uuid.UUID) -> Any:
        return {"order_id": f"o-{i}"} if payload is None else payload

    return insert_pending(sessions, clock.now_ms(), n, tables=tables, type_=type_, payload=body,
                          headers=lambda mid: {"correlation_id": str(mid)})

def rows(sessions: sessionmaker[Session], tables: Tables) -> list[OutboxRow]:
    with sessions() as s:
        return list(s.scalars(sa.select(tables.outbox).order_by(tables.outbox.seq)))


def run(sessions: sessionmaker[Session], publisher: InMemoryPublisher, clock: ManualClock, tables: Tables,
        **kw: Any) -> BatchResult:
    opts: dict[str, Any] = {"batch_size": 100, "max_attempts": 3, "base_delay_ms": 1_000,
                            "max_delay_ms": 60_000, "routes": ROUTES, "max_message_bytes": 256 * 1024,
                            "namespace": NS}
    opts.update(kw)
    with sessions() as s:
        return dispatch_batch(s, publisher, clock, tables=tables, **opts)


def test_publishes_due_rows_in_seq_order_one_celery_message_per_consumer(
        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given three pending OrderPlaced rows
    ids = insert(sqlite_sessions, clock, tables, 3)
    pub = InMemoryPublisher()
    # When one batch runs
    result = run(sqlite_sessions, pub, clock, tables)
    # Then every row went to every consumer's queue, in seq order, and is marked published
    assert (result.claimed, result.published, result.messages_sent) == (3, 3, 12)
    assert [m.headers["outbox_message_id"] for m in pub.published[::4]] == [str(i) for i in ids]
    first = pub.published[:4]
    assert [m.routing_key for m in first] == [f"{NS}.{c}" for c in ROUTES["OrderPlaced"]]
    assert [m.headers["task"] for m in first] == [f"consumers.{c}" for c in ROUTES["OrderPlaced"]]
    args, kwargs, _embed = json.loads(first[0].body)
    assert kwargs == {} and args[0]["message_id"] == str(ids[0]) and args[0]["payload"] == {"order_id": "o-0"}
    assert all(r.published_at_ms == clock.now_ms() for r in rows(sqlite_sessions, tables))
    # And a second pass has nothing left to do
    assert run(sqlite_sessions, pub, clock, tables).claimed == 0


def test_one_update_statement_marks_the_whole_batch(sqlite_engine: sa.Engine,
                                                    sqlite_sessions: sessionmaker[Session],
                                                    clock: ManualClock, tables: Tables) -> None:
    # Given 50 pending rows and a counter of UPDATE statements sent to the database
    insert(sqlite_sessions, clock, tables, 50)
    updates: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("UPDATE"):
            updates.append(statement)

    sa.event.listen(sqlite_engine, "before_cursor_execute", count)
    try:
        result = run(sqlite_sessions, InMemoryPublisher(), clock, tables, batch_size=50)
    finally:
        sa.event.remove(sqlite_engine, "before_cursor_execute", count)
    # Then all 50 are marked by exactly one UPDATE
    assert result.published == 50
    assert len(updates) == 1, updates


def test_batch_size_limits_the_claim_and_later_rows_wait(sqlite_sessions: sessionmaker[Session],
                                                          clock: ManualClock, tables: Tables) -> None:
    ids = insert(sqlite_sessions, clock, tables, 5)
    pub = InMemoryPublisher()
    assert run(sqlite_sessions, pub, clock, tables, batch_size=2).published == 2
    assert pub.message_ids()[::4] == [str(ids[0]), str(ids[1])]
    assert run(sqlite_sessions, pub, clock, tables, batch_size=2).published == 2
    assert run(sqlite_sessions, pub, clock, tables, batch_size=2).published == 1
    assert run(sqlite_sessions, pub, clock, tables, batch_size=2).claimed == 0


def test_rows_whose_backoff_has_not_passed_are_not_claimed(sqlite_sessions: sessionmaker[Session],
                                                            clock: ManualClock, tables: Tables) -> None:
    insert(sqlite_sessions, clock, tables, 1)
    with sqlite_sessions() as s:
        s.execute(sa.update(tables.outbox).values(next_attempt_at_ms=clock.now_ms() + 5_000))
        s.commit()
    pub = InMemoryPublisher()
    assert run(sqlite_sessions, pub, clock, tables).claimed == 0
    clock.advance(5_000)
    assert run(sqlite_sessions, pub, clock, tables).published == 1


def test_unknown_type_is_dead_lettered_at_once_and_does_not_block_rows_behind(
        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given a row of a type nobody is routed for, then a normal row
    insert(sqlite_sessions, clock, tables, 1, type_="OrderTeleported")
    good = insert(sqlite_sessions, clock, tables, 1)
    pub = InMemoryPublisher()
    # When one batch runs
    result = run(sqlite_sessions, pub, clock, tables)
    # Then the bad row is dead-lettered with a clear reason and the good one is published
    assert (result.dead_lettered, result.published) == (1, 1)
    bad, ok = rows(sqlite_sessions, tables)
    assert result.dead_lettered_rows == [(str(bad.message_id), bad.last_error)]
    assert bad.dead_lettered_at_ms == clock.now_ms() and bad.published_at_ms is None
    assert bad.last_error is not None and "no route for event type 'OrderTeleported'" in bad.last_error
    assert ok.published_at_ms is not None and pub.message_ids()[0] == str(good[0])
    # And it is never picked again
    clock.advance(10**9)
    assert run(sqlite_sessions, pub, clock, tables).claimed == 0


def test_payload_that_cannot_be_serialised_is_dead_lettered(sqlite_sessions: sessionmaker[Session],
                                                            clock: ManualClock, tables: Tables) -> None:
    # Given a row whose stored payload is not strict JSON (NaN): written around the library's writer before the
    # json_valid CHECK (migration co0008), which refuses such a row now, as Postgres' jsonb does
    with sqlite_sessions() as s:
        s.execute(sa.text("PRAGMA ignore_check_constraints = ON"))
        s.add(tables.outbox(message_id=uuid.uuid4(), type="OrderPlaced", payload={"total": float("nan")}, headers={},
                            created_at_ms=clock.now_ms(), next_attempt_at_ms=clock.now_ms(), attempts=0))
        s.flush()
        s.execute(sa.text("PRAGMA ignore_check_constraints = OFF"))
        s.commit()
    insert(sqlite_sessions, clock, tables, 1)
    result = run(sqlite_sessions, InMemoryPublisher(), clock, tables)
    assert (result.dead_lettered, result.published) == (1, 1)
    bad = rows(sqlite_sessions, tables)[0]
    assert bad.last_error is not None and "cannot be encoded as JSON" in bad.last_error


def test_message_over_the_size_limit_is_dead_lettered(sqlite_sessions: sessionmaker[Session],
                                                      clock: ManualClock, tables: Tables) -> None:
    insert(sqlite_sessions, clock, tables, 1, payload={"blob": "x" * 5_000})
    insert(sqlite_sessions, clock, tables, 1)
    pub = InMemoryPublisher()
    result = run(sqlite_sessions, pub, clock, tables, max_message_bytes=2_000)
    assert (result.dead_lettered, result.published) == (1, 1)
    bad = rows(sqlite_sessions, tables)[0]
    assert bad.last_error is not None and "over the limit of 2000 bytes" in bad.last_error
    assert len(pub.published) == 4


class Recorder:
    def __init__(self, pub: InMemoryPublisher) -> None:
        self.pub = pub
        self.seen: list[tuple[str, int]] = []

    def reached(self, name: str) -> None:
        self.seen.append((name, len(self.pub.published)))


def test_crash_points_are_reached_around_publish_and_mark(sqlite_sessions: sessionmaker[Session],
                                                          clock: ManualClock, tables: Tables) -> None:
    insert(sqlite_sessions, clock, tables, 1)
    pub = InMemoryPublisher()
    rec = Recorder(pub)
    run(sqlite_sessions, pub, clock, tables, crash_points=rec)
    assert rec.seen == [("after_claim_before_publish", 0), ("after_publish_before_mark", 4), ("after_mark", 4)]


@pytest.mark.parametrize("batch_size", [1, 7])
def test_every_row_is_published_exactly_once_when_nothing_fails(sqlite_sessions: sessionmaker[Session],
                                                                 clock: ManualClock, tables: Tables, batch_size: int) -> None:
    ids = insert(sqlite_sessions, clock, tables, 20)
    pub = InMemoryPublisher()
    while run(sqlite_sessions, pub, clock, tables, batch_size=batch_size).claimed:
        pass
    assert pub.duplicates() == 0
    assert set(pub.message_ids()) == {str(i) for i in ids}
