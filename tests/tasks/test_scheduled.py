"""Scheduled tasks held in the outbox: a countdown/eta further ahead than ``enqueue_hold_eta_after_ms`` is a
row due at its eta, published then without an eta (docs/scheduled.md).

SQLite and Postgres (``any_sessions``); the relay is ``celery_outbox.testing.drain`` (in-memory publisher)
or a real ``RelayLoop``; Celery's clock is frozen with freezegun and the outbox's ``ManualClock`` is set to
the same instant, so both agree on "now".
"""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from freezegun import freeze_time
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import ManualClock, Settings, Tables
from celery_outbox.clock import SystemClock
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.testing import InMemoryPublisher, drain
from devtools.processes import wait_until
from tests.tasks.test_enqueue import TaskApp, body

T0 = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
T0_MS = int(T0.timestamp() * 1000)


@pytest.fixture
def tasks(any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> TaskApp:
    clock.set(T0_MS)
    return TaskApp(any_sessions, clock, tables, f"sched-{uuid.uuid4().hex[:8]}")


def test_a_long_countdown_is_a_row_due_at_its_eta_published_then_without_eta(tasks: TaskApp,
                                                                             clock: ManualClock) -> None:
    # Given a task sent with an hour's countdown inside a transaction
    with freeze_time(T0), tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        result = tasks.mail.apply_async(("a@example.com",), countdown=3600)
    # Then it is one pending row due in an hour, its message without an eta
    [row] = tasks.rows()
    due = T0_MS + 3_600_000
    assert row.next_attempt_at_ms == due and row.created_at_ms == T0_MS
    assert row.headers["held_until_ms"] == due and row.headers["task_headers"]["eta"] is None
    # When the relay runs a millisecond before it is due, Then nothing is published
    clock.set(due - 1)
    assert drain(tasks.outbox).published == []
    # When it runs at the due time, Then the task goes out once, with its id and arguments and no eta
    clock.set(due)
    [m] = drain(tasks.outbox).published
    assert m.headers["id"] == result.id and m.headers["eta"] is None
    assert body(m)[:2] == [["a@example.com"], {}]
    assert drain(tasks.outbox).published == []


def test_an_eta_within_the_threshold_is_sent_as_celery_sent_it(tasks: TaskApp) -> None:
    # Given a task with a countdown under the 1 s default threshold
    with freeze_time(T0), tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        tasks.mail.apply_async(("a@example.com",), countdown=0.5)
    # Then its row is due at once and its message keeps Celery's eta
    [row] = tasks.rows()
    assert row.next_attempt_at_ms == T0_MS and "held_until_ms" not in row.headers
    [m] = drain(tasks.outbox).published
    assert datetime.fromisoformat(m.headers["eta"]) == T0 + timedelta(seconds=0.5)


@pytest.mark.parametrize(("threshold_ms", "held"), [(1, True), (600_000, False)])
def test_the_threshold_is_a_setting(any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables,
                                    threshold_ms: int, held: bool) -> None:
    # Given the threshold at 1 ms (hold every eta ahead) or at ten minutes
    clock.set(T0_MS)
    tasks = TaskApp(any_sessions, clock, tables, "sched-threshold", enqueue_hold_eta_after_ms=threshold_ms)
    # When a task is sent with a 2 s countdown, and with an explicit eta 5 minutes ahead
    with freeze_time(T0), tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        tasks.mail.apply_async(("a@example.com",), countdown=2)
        tasks.mail.apply_async(("b@example.com",), eta=T0 + timedelta(minutes=5))
    # Then both are held (1 ms) or both keep their eta and are due now (ten minutes)
    due = [r.next_attempt_at_ms for r in tasks.rows()]
    assert due == ([T0_MS + 2_000, T0_MS + 300_000] if held else [T0_MS, T0_MS])


def test_a_naive_eta_is_read_as_utc_as_the_worker_reads_it(any_sessions: sessionmaker[Session],
                                                            clock: ManualClock, tables: Tables) -> None:
    # Given an app whose timezone is UTC+2 and a naive eta two hours after now in UTC
    clock.set(T0_MS)
    tasks = TaskApp(any_sessions, clock, tables, "sched-tz")
    tasks.app.conf.timezone = "Etc/GMT-2"
    with freeze_time(T0), tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        tasks.mail.apply_async(("a@example.com",), eta=(T0 + timedelta(hours=2)).replace(tzinfo=None))
    # Then it is held until two hours after now: Celery's worker reads a naive eta as UTC whatever the timezone
    [row] = tasks.rows()
    assert row.next_attempt_at_ms == T0_MS + 2 * 3_600_000


def test_held_rows_never_delay_due_ones_and_go_out_when_due(tasks: TaskApp, clock: ManualClock) -> None:
    # Given three tasks held for a day, then two sent at once (higher seq)
    with freeze_time(T0), tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        held = [tasks.mail.apply_async((f"held{i}@example.com",), countdown=86_400).id for i in range(3)]
        now = [tasks.mail.delay(f"now{i}@example.com").id for i in range(2)]
    # When the relay drains with a batch of one
    publisher = InMemoryPublisher()
    tasks.outbox.settings = Settings(relay_batch_size=1, relay_max_in_flight_rows=1)
    drain(tasks.outbox, publisher)
    # Then the due ones went out in their order, the held ones stay pending
    assert publisher.message_ids() == now
    clock.advance(86_400_000)
    drain(tasks.outbox, publisher)
    assert publisher.message_ids() == now + held


def test_the_loop_waits_no_longer_than_until_the_next_due_row(tasks: TaskApp, clock: ManualClock) -> None:
    loop = RelayLoop(settings=Settings(relay_poll_interval_s=60.0), tables=tasks.tables,
                     session_factory=tasks.sessions, publisher=InMemoryPublisher(), clock=clock, listen=False)
    try:
        # Given nothing pending, Then the loop waits the poll interval
        assert loop.until_next_due_s() == 60.0
        # Given a task due in 3 s, Then it waits 3 s
        with freeze_time(T0), tasks.sessions.begin() as s, tasks.outbox.transaction(s):
            tasks.mail.apply_async(("a@example.com",), countdown=3)
        assert loop.until_next_due_s() == 3.0
        # Given it is past due (another relay holds it, say), Then it waits 10 ms, never a busy loop
        clock.advance(5_000)
        assert loop.until_next_due_s() == 0.01
    finally:
        loop.close()


@pytest.mark.postgres
def test_a_running_relay_publishes_a_held_task_when_due_not_at_its_poll_interval(
        pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a real relay loop on Postgres (NOTIFY on) polling only every 120 s, waiting with nothing to do
    tasks = TaskApp(pg_sessions, ManualClock(), tables, "sched-loop")
    tasks.outbox.clock = SystemClock()
    publisher = InMemoryPublisher()
    loop = RelayLoop(settings=Settings(relay_poll_interval_s=120.0), tables=tables, session_factory=pg_sessions,
                     publisher=publisher, clock=SystemClock())
    thread = threading.Thread(target=loop.run, kwargs={"handle_signals": False}, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: loop.stats.listening and loop.stats.waits > 0, timeout_s=30)
        # When a task with a 2 s countdown is committed (its NOTIFY wakes the loop, which finds nothing due)
        with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
            result = tasks.mail.apply_async(("a@example.com",), countdown=2)
        [row] = tasks.rows()
        # Then the loop publishes it once it is due, long before its next poll, and never before it is due
        assert wait_until(lambda: publisher.message_ids() == [result.id], timeout_s=60)
        # (the relay marks the row after the broker confirmed it: publish-before-mark, docs/guarantees.md)
        assert wait_until(lambda: tasks.rows()[0].published_at_ms is not None, timeout_s=30)
        [published] = tasks.rows()
        assert published.published_at_ms is not None and published.published_at_ms >= row.next_attempt_at_ms
    finally:
        loop.stop()
        thread.join(timeout=30)
        loop.close()
    assert not thread.is_alive()
