"""``outbox.cancel(session, task_id)``: a pending task row is deleted in the caller's transaction and never
published; a cancel after publish raises ``AlreadyPublishedError``, never silently ignored (docs/scheduled.md).

SQLite and Postgres (``any_sessions``), the relay is ``celery_outbox.testing.drain``; no worker exists at all
while cancelling (the cancel is a database write, not a broker message).
"""

from __future__ import annotations

import threading
import uuid

import pytest
import sqlalchemy as sa
from freezegun import freeze_time
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import AlreadyPublishedError, ManualClock, NotFoundError, Tables, ValidationError, counters
from celery_outbox.relay.dispatch import InFlight, RelayConfig, claim_batch, finish_batch, send_claimed
from celery_outbox.testing import InMemoryPublisher, drain
from tests.tasks.test_enqueue import TaskApp
from tests.tasks.test_scheduled import T0, T0_MS


@pytest.fixture
def tasks(any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> TaskApp:
    clock.set(T0_MS)
    return TaskApp(any_sessions, clock, tables, f"cancel-{uuid.uuid4().hex[:8]}")


def cancelled_count(tasks: TaskApp) -> int:
    with tasks.sessions() as s:
        return counters.value(s, "_relay", "cancelled", tables=tasks.tables)


def test_a_cancelled_reminder_is_never_published(tasks: TaskApp, clock: ManualClock) -> None:
    # Given a reminder due in an hour, committed
    with freeze_time(T0), tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        reminder = tasks.mail.apply_async(("a@example.com",), countdown=3600)
    # When it is cancelled in a later transaction (no worker anywhere)
    with tasks.sessions.begin() as s:
        cancelled = tasks.outbox.cancel(s, reminder.id)
    # Then the cancel says what it removed, the row is gone and counted, and nothing is ever published
    assert (str(cancelled.message_id), cancelled.type, cancelled.due_at_ms) == (reminder.id, "enq.mail",
                                                                                T0_MS + 3_600_000)
    assert tasks.rows() == [] and cancelled_count(tasks) == 1
    clock.advance(2 * 3_600_000)
    assert drain(tasks.outbox).published == []


def test_a_cancel_rolled_back_cancels_nothing(tasks: TaskApp, clock: ManualClock) -> None:
    # Given a reminder, and a cancel whose transaction rolls back
    with freeze_time(T0), tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        reminder = tasks.mail.apply_async(("a@example.com",), countdown=60)
    with pytest.raises(RuntimeError), tasks.sessions.begin() as s:
        tasks.outbox.cancel(s, reminder.id)
        raise RuntimeError("the view failed")
    # Then the reminder still goes out when due
    clock.advance(60_000)
    assert drain(tasks.outbox).message_ids() == [reminder.id]


def test_a_task_cancelled_in_the_transaction_that_sent_it_never_exists(tasks: TaskApp) -> None:
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        sent = tasks.mail.delay("a@example.com")
        tasks.outbox.cancel(s, sent.id)
    assert tasks.rows() == [] and drain(tasks.outbox).published == []


def test_a_cancel_after_publish_is_reported_and_the_callers_transaction_goes_on(tasks: TaskApp) -> None:
    # Given a task the relay has already published
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        sent = tasks.mail.delay("a@example.com")
    assert drain(tasks.outbox).message_ids() == [sent.id]
    # When it is cancelled, Then the cancel raises saying so, and the caller's transaction can still commit
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        with pytest.raises(AlreadyPublishedError, match=f"task {sent.id} was already published"):
            tasks.outbox.cancel(s, sent.id)
        tasks.mail.delay("b@example.com")
    assert len(tasks.rows()) == 2 and cancelled_count(tasks) == 0


def test_an_unknown_or_malformed_task_id_is_a_clear_error(tasks: TaskApp) -> None:
    with tasks.sessions.begin() as s:
        with pytest.raises(NotFoundError, match="no outbox row has task id"):
            tasks.outbox.cancel(s, str(uuid.uuid4()))
        with pytest.raises(ValidationError, match="is not a UUID; nothing was cancelled"):
            tasks.outbox.cancel(s, "not-a-uuid")


@pytest.mark.postgres
def test_postgres_a_cancel_racing_the_relay_waits_and_reports_the_publish(pg_sessions: sessionmaker[Session],
                                                                         tables: Tables) -> None:
    tasks = TaskApp(pg_sessions, ManualClock(start_ms=T0_MS), tables, "cancel-race")
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        sent = tasks.mail.delay("a@example.com")
    # Given the relay has claimed the row (FOR UPDATE SKIP LOCKED) and put it on the wire, not yet marked
    relay_session, publisher = pg_sessions(), InMemoryPublisher()
    config = RelayConfig(tables=tables, routes={}, max_message_bytes=256 * 1024, max_attempts=3, base_delay_ms=1000,
                         max_delay_ms=1000)
    claimed = claim_batch(relay_session, tasks.outbox.clock, config, limit=10)
    flight = send_claimed(claimed, publisher, tasks.outbox.clock, config)
    assert publisher.message_ids() == [sent.id]
    # When a cancel runs meanwhile
    outcome: list[BaseException | None] = []

    def cancel() -> None:
        try:
            with tasks.sessions.begin() as s:
                tasks.outbox.cancel(s, sent.id)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=cancel)
    thread.start()
    with pg_sessions() as watcher:  # the cancel's DELETE waits on the relay's row lock
        assert_waits = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'DELETE%'"
        for _ in range(600):
            waiting = watcher.execute(sa.text(assert_waits)).scalar_one()
            watcher.rollback()  # pg_stat_activity is a snapshot per transaction: look again in a new one
            if waiting:
                break
            thread.join(timeout=0.05)
        else:
            pytest.fail("the cancel never waited on the relay's lock")
    # And the relay marks and commits
    assert isinstance(flight, InFlight)
    finish_batch(flight, tasks.outbox.clock, config)
    relay_session.close()
    thread.join(timeout=30)
    # Then the cancel reports the publish, it did not delete the published row
    [error] = outcome
    assert isinstance(error, AlreadyPublishedError)
    [row] = tasks.rows()
    assert row.published_at_ms is not None
