"""docs/design.md, rule 3: message-specific failures are charged to the row; a broker outage is not."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.relay.breaker import BreakerState, CircuitBreaker
from celery_outbox.relay.dispatch import BatchResult, backoff_ms, dispatch_batch
from celery_outbox.schema import OutboxRow, Tables
from celery_outbox.testing.memory import InMemoryPublisher
from tests.outbox_rows import insert_pending

ROUTES = {"OrderPlaced": ("shipping", "billing")}


def insert(sessions: sessionmaker[Session], clock: ManualClock, tables: Tables, n: int = 1) -> list[uuid.UUID]:
    return insert_pending(sessions, clock.now_ms(), n, tables=tables, payload=lambda i, mid: {"n": 1})

def only_row(sessions: sessionmaker[Session], tables: Tables) -> OutboxRow:
    with sessions() as s:
        return s.scalars(sa.select(tables.outbox)).one()


def all_rows(sessions: sessionmaker[Session], tables: Tables) -> list[OutboxRow]:
    with sessions() as s:
        return list(s.scalars(sa.select(tables.outbox)))


def run(sessions: sessionmaker[Session], pub: InMemoryPublisher, clock: ManualClock, tables: Tables,
        **kw: Any) -> BatchResult:
    opts: dict[str, Any] = {"batch_size": 100, "max_attempts": 3, "base_delay_ms": 1_000,
                            "max_delay_ms": 60_000, "routes": ROUTES, "max_message_bytes": 10_000}
    opts.update(kw)
    with sessions() as s:
        return dispatch_batch(s, pub, clock, tables=tables, **opts)


def test_message_rejected_once_is_charged_backs_off_then_delivers(sqlite_sessions: sessionmaker[Session],
                                                                 clock: ManualClock, tables: Tables) -> None:
    # Given a row and a broker that nacks this message once
    [mid] = insert(sqlite_sessions, clock, tables)
    pub = InMemoryPublisher()
    pub.reject(mid, times=1, error="broker nacked the message")
    # When the relay runs
    first = run(sqlite_sessions, pub, clock, tables)
    # Then the row carries one attempt, the error, and a backoff
    row = only_row(sqlite_sessions, tables)
    assert first.failed == 1 and first.published == 0
    assert row.attempts == 1 and row.published_at_ms is None and row.dead_lettered_at_ms is None
    assert row.last_error == "shipping: broker nacked the message"
    assert row.next_attempt_at_ms == clock.now_ms() + 1_000
    # When an immediate second pass runs, then nothing is published (not due)
    assert run(sqlite_sessions, pub, clock, tables).claimed == 0
    # When the clock passes the first backoff, then the third pass delivers
    clock.advance(1_000)
    third = run(sqlite_sessions, pub, clock, tables)
    assert third.published == 1
    assert only_row(sqlite_sessions, tables).published_at_ms == clock.now_ms()


def test_broker_unavailable_once_is_not_charged_and_the_breaker_backs_off(
        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given a row and a broker that is unreachable once (the "fail once", under rule 3)
    insert(sqlite_sessions, clock, tables)
    pub = InMemoryPublisher()
    pub.fail_unavailable(1)
    breaker = CircuitBreaker(base_ms=2_000, max_ms=60_000)
    # When the relay runs
    first = run(sqlite_sessions, pub, clock, tables, breaker=breaker)
    # Then nothing is charged to the row; the relay as a whole backs off
    assert first.broker_unavailable and first.error == "broker unavailable: connection refused"
    row = only_row(sqlite_sessions, tables)
    assert (row.attempts, row.last_error, row.published_at_ms) == (0, None, None)
    assert breaker.state(clock.now_ms()) is BreakerState.OPEN
    # When an immediate second pass runs, then nothing is even tried
    second = run(sqlite_sessions, pub, clock, tables, breaker=breaker)
    assert second.breaker_open and second.claimed == 0 and pub.calls == 1
    # When the clock passes the breaker's backoff, then the probe delivers and closes the breaker
    clock.advance(2_000)
    assert run(sqlite_sessions, pub, clock, tables, breaker=breaker).published == 1
    assert breaker.state(clock.now_ms()) is BreakerState.CLOSED


def test_message_the_broker_keeps_rejecting_is_dead_lettered_after_max_attempts(
        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given a broker that rejects this message 100 times, and max_attempts = 3
    [mid] = insert(sqlite_sessions, clock, tables)
    pub = InMemoryPublisher()
    pub.reject(mid, times=100, error="returned: NO_ROUTE")
    delays = []
    # When the relay runs whenever the row is due
    results = []
    for _ in range(3):
        before = clock.now_ms()
        results.append(run(sqlite_sessions, pub, clock, tables))
        row = only_row(sqlite_sessions, tables)
        delays.append(row.next_attempt_at_ms - before)
        clock.set(row.next_attempt_at_ms)
    # Then it took three attempts with doubling backoff and is dead-lettered
    row = only_row(sqlite_sessions, tables)
    assert row.attempts == 3 and row.dead_lettered_at_ms is not None and row.published_at_ms is None
    assert row.last_error == "shipping: returned: NO_ROUTE"
    assert delays[:2] == [1_000, 2_000]
    # And only the last pass reports it dead-lettered (what the relay task announces to Flower)
    assert [r.dead_lettered_rows for r in results] == [[], [], [(str(mid), "shipping: returned: NO_ROUTE")]]
    # And a recovered broker never receives it
    pub.recover()
    clock.advance(10**9)
    assert run(sqlite_sessions, pub, clock, tables).claimed == 0
    assert pub.published == []


def test_broker_down_for_an_hour_dead_letters_nothing_and_the_backlog_drains(
        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given 30 rows, max_attempts = 3, and a broker down for an hour of fake clock
    ids = insert(sqlite_sessions, clock, tables, 30)
    pub = InMemoryPublisher()
    pub.fail_unavailable(10**6)
    breaker = CircuitBreaker(base_ms=1_000, max_ms=60_000)
    start = clock.now_ms()
    # When the relay ticks every second for the whole hour
    while clock.now_ms() - start < 3_600_000:
        result = run(sqlite_sessions, pub, clock, tables, breaker=breaker, batch_size=10)
        assert result.broker_unavailable and result.published == 0
        clock.advance(1_000)
    # Then no row was charged or dead-lettered, and the breaker probed with backoff, not 3600 times
    assert all(r.attempts == 0 and r.dead_lettered_at_ms is None for r in all_rows(sqlite_sessions, tables))
    assert 5 < pub.unavailable_calls < 100, pub.unavailable_calls
    # When the broker returns, then the backlog drains by itself
    pub.recover()
    clock.advance(breaker.wait_ms(clock.now_ms()))
    for _ in range(10):
        if run(sqlite_sessions, pub, clock, tables, breaker=breaker, batch_size=10).claimed == 0:
            break
    assert {r.published_at_ms is not None for r in all_rows(sqlite_sessions, tables)} == {True}
    assert set(pub.message_ids()) == {str(i) for i in ids} and pub.duplicates() == 0


def test_connection_lost_mid_batch_republishes_the_batch_never_loses(sqlite_sessions: sessionmaker[Session],
                                                                     clock: ManualClock, tables: Tables) -> None:
    # Given 3 rows and a broker that takes 3 of the 6 messages, then drops the connection
    ids = insert(sqlite_sessions, clock, tables, 3)
    pub = InMemoryPublisher()
    pub.unavailable_after(3)
    first = run(sqlite_sessions, pub, clock, tables)
    # Then the whole batch stays pending, uncharged, with the duplicates it risks counted
    assert first.broker_unavailable and first.duplicates_risked == 3
    assert all(r.published_at_ms is None and r.attempts == 0 for r in all_rows(sqlite_sessions, tables))
    # When the relay runs again, every message arrives; the ones already there arrive twice
    assert run(sqlite_sessions, pub, clock, tables).published == 3
    assert set(pub.message_ids()) == {str(i) for i in ids}
    assert pub.duplicates() == 3


@pytest.mark.parametrize(("attempts", "expected"), [(1, 1_000), (2, 2_000), (3, 4_000), (7, 60_000), (60, 60_000)])
def test_backoff_doubles_and_is_capped(attempts: int, expected: int) -> None:
    assert backoff_ms(attempts, base_delay_ms=1_000, max_delay_ms=60_000) == expected
