"""``outbox stats`` and the metrics with tasks held for later: a reminder due tomorrow is not a stuck backlog
(docs/scheduled.md "Stats"). SQLite and Postgres."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from freezegun import freeze_time
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import ManualClock, Tables
from celery_outbox.clock import SystemClock
from celery_outbox.ops import stats as ops_stats
from celery_outbox.testing import drain
from tests.ops.test_stuck_backlog import run
from tests.ops_seed import outbox_row
from tests.tasks.test_enqueue import TaskApp

T0 = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
T0_MS = int(T0.timestamp() * 1000)
DAY_MS = 86_400_000


@pytest.fixture
def tasks(any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> TaskApp:
    clock.set(T0_MS)
    return TaskApp(any_sessions, clock, tables, f"stats-{uuid.uuid4().hex[:8]}")


def collect(tasks: TaskApp, clock: ManualClock) -> ops_stats.Stats:
    with tasks.sessions() as s:
        return ops_stats.collect(s, tables=tasks.tables, clock=clock)


def test_a_task_held_until_tomorrow_is_scheduled_not_an_old_pending_row(tasks: TaskApp, clock: ManualClock) -> None:
    # Given a reminder held for a day and another for two days, sent at T0
    with freeze_time(T0), tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        tasks.mail.apply_async(("a@example.com",), countdown=DAY_MS // 1000)
        tasks.mail.apply_async(("b@example.com",), countdown=2 * DAY_MS // 1000)
    # When an hour passes
    clock.set(T0_MS + 3_600_000)
    st = collect(tasks, clock)
    # Then nothing ages: both are scheduled, the first due in a day
    assert (st.pending, st.due, st.oldest_pending_age_ms, st.oldest_overdue_ms) == (2, 0, None, None)
    assert (st.scheduled, st.next_due_at_ms) == (2, T0_MS + DAY_MS)
    # When a task is sent now and not published for 30 s
    with freeze_time(T0), tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        tasks.mail.apply_async(("c@example.com",))
    clock.advance(30_000)
    # Then the oldest pending row is that one, 30 s old, and the held ones stay scheduled
    st = collect(tasks, clock)
    assert (st.pending, st.due, st.oldest_pending_age_ms, st.scheduled) == (3, 1, 30_000, 2)
    assert st.to_dict()["outbox"]["scheduled"] == 2


def test_a_held_task_ages_from_its_eta_once_due(tasks: TaskApp, clock: ManualClock) -> None:
    # Given a task held for a day, which comes due with no relay running
    with freeze_time(T0), tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        tasks.mail.apply_async(("a@example.com",), countdown=DAY_MS // 1000)
    clock.set(T0_MS + DAY_MS + 45_000)
    # Then it is no longer scheduled: it has waited 45 s since its eta (not a day since it was written)
    st = collect(tasks, clock)
    assert (st.scheduled, st.next_due_at_ms, st.due) == (0, None, 1)
    assert st.oldest_pending_age_ms == 45_000 and st.oldest_overdue_ms == 45_000
    # When the relay publishes it, Then nothing is pending
    assert len(drain(tasks.outbox).published) == 1
    st = collect(tasks, clock)
    assert (st.pending, st.scheduled, st.oldest_pending_age_ms) == (0, 0, None)


def test_a_held_task_whose_publish_failed_ages_from_its_eta_while_it_backs_off(tasks: TaskApp,
                                                                            clock: ManualClock) -> None:
    # Given a task held for a day, due and rejected once by the broker (it backs off, attempts 1)
    with freeze_time(T0), tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        tasks.mail.apply_async(("a@example.com",), countdown=DAY_MS // 1000)
    with tasks.sessions.begin() as s:
        row = s.query(tasks.tables.outbox).one()
        row.attempts, row.next_attempt_at_ms, row.last_error = 1, T0_MS + DAY_MS + 120_000, "nacked"
    clock.set(T0_MS + DAY_MS + 60_000)
    # Then it is late, not scheduled: a minute since its eta, not due, retrying
    st = collect(tasks, clock)
    assert (st.scheduled, st.due, st.retrying, st.oldest_pending_age_ms) == (0, 0, 1, 60_000)


def test_the_stats_command_shows_scheduled_rows_apart_and_no_threshold_trips_on_them(
        sqlite_sessions: sessionmaker[Session], sqlite_url: str, tables: Tables, tmp_home: Path, namespace: str) -> None:
    # Given a row written a day ago and held until an hour from now (as enqueue writes it)
    now = SystemClock().now_ms()
    with sqlite_sessions() as s:
        row = outbox_row(s, tables=tables, created_at_ms=now - DAY_MS, type="tests.remind")
        row.next_attempt_at_ms = now + 3_600_000
        row.headers = {**row.headers, "held_until_ms": now + 3_600_000}
        s.commit()
    env = {"OUTBOX_DATABASE_URL": sqlite_url, "OUTBOX_HOME": str(tmp_home), "OUTBOX_NAMESPACE": namespace,
           "OUTBOX_BROKER_URL": "memory://"}
    # When the on-call person asks, with an age limit of 5 minutes
    r = run(env, "stats", "--max-pending-age", "5m", "--max-overdue", "1m")
    # Then no threshold is crossed and the row is shown as scheduled, due in about an hour
    assert r.exit_code == 0, r.output
    assert "scheduled: 1, next due at " in r.stdout and "(in 59m" in r.stdout
    data = json.loads(run(env, "stats", "--json").stdout)["outbox"]
    assert (data["scheduled"], data["oldest_pending_age_ms"]) == (1, None)
    assert data["next_due_at_ms"] == now + 3_600_000
