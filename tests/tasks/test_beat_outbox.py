"""Periodic tasks through the outbox (celery_outbox/celery/beat.py, docs/scheduled.md "Periodic tasks"): in
the beat process a tick of an ``outbox.periodic`` entry is a row whose task id is made from the entry and the
period the tick falls in; the same tick sent again (a restarted beat) writes nothing, the next period's does.

In process: beat's send path is ``task.apply_async(args, kwargs, **entry["options"])`` with the process
marked as beat (what the ``beat_init`` signal does); SQLite and Postgres.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from celery.schedules import crontab
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import ConfigError, ManualClock, Tables
from celery_outbox.celery import beat
from celery_outbox.testing import drain
from tests.tasks.test_enqueue import TaskApp

T0_MS = 1_900_000_000_000  # a multiple of 10 s
EVERY_S = 10


@pytest.fixture
def tasks(any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables,
          monkeypatch: pytest.MonkeyPatch) -> TaskApp:
    clock.set(T0_MS)
    t = TaskApp(any_sessions, clock, tables, f"beat-{uuid.uuid4().hex[:8]}")
    monkeypatch.setattr(t.outbox._enqueue_interceptor, "in_beat", True)
    t.outbox.periodic("mail-every-10s", "enq.mail", EVERY_S, args=("ops@example.com",))
    return t


def fire(tasks: TaskApp) -> Any:
    """What beat does when the entry is due."""
    entry = tasks.app.conf.beat_schedule["mail-every-10s"]
    return tasks.app.tasks[entry["task"]].apply_async(entry["args"], entry["kwargs"], **entry["options"])


def test_a_tick_sent_twice_in_its_period_is_one_row_and_the_next_period_is_another(tasks: TaskApp,
                                                                                    clock: ManualClock) -> None:
    # Given beat fires the entry, then fires it again in the same period (restarted from a stale schedule file)
    clock.set(T0_MS + 1_000)
    fire(tasks)
    clock.set(T0_MS + 9_999)
    fire(tasks)
    # Then one row, the tick's, with the tick's own id and no beat headers on the message
    [row] = tasks.rows()
    key = f"beat:mail-every-10s:{T0_MS}"
    assert row.headers[beat.TICK_HEADER] == key and row.message_id == uuid.uuid5(beat.NAMESPACE, key)
    [m] = drain(tasks.outbox).published
    assert m.headers["id"] == str(row.message_id)
    assert beat.BEAT_HEADER not in m.headers and beat.BEAT_EVERY_HEADER not in m.headers
    # When it fires again in that period after the row was published, Then still nothing is written
    fire(tasks)
    assert len(tasks.rows()) == 1
    # When the next period comes, Then its tick is a new row
    clock.set(T0_MS + 10_000)
    fire(tasks)
    assert [r.headers[beat.TICK_HEADER] for r in tasks.rows()] == [key, f"beat:mail-every-10s:{T0_MS + 10_000}"]


def test_outside_beat_and_for_plain_entries_nothing_changes(tasks: TaskApp, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a plain beat entry (no outbox headers) in beat, Then it goes to the broker as Celery sends it
    tasks.mail.apply_async(("a@example.com",))
    assert tasks.rows() == [] and len(tasks.broker_messages()) == 1
    # Given the outbox entry's message outside beat (a person calling it), Then it is an ordinary task row
    monkeypatch.setattr(tasks.outbox._enqueue_interceptor, "in_beat", False)
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        fire(tasks)
    [row] = tasks.rows()
    assert beat.TICK_HEADER not in row.headers


@pytest.mark.parametrize(("schedule", "every_ms"), [(10, 10_000), (2.5, 2_500), (timedelta(minutes=5), 300_000),
                                                    (crontab(minute="*/15"), 60_000)])
def test_a_schedule_gives_its_period(schedule: Any, every_ms: int) -> None:
    assert beat.entry("e", "t", schedule)["options"]["headers"][beat.BEAT_EVERY_HEADER] == every_ms


@pytest.mark.parametrize("schedule", [0, 0.5, -1, float("nan"), True, "10", 10 ** 9])
def test_bad_schedules_and_names_are_refused(schedule: Any) -> None:
    with pytest.raises(ConfigError, match="schedule of 1 s to a year"):
        beat.entry("e", "t", schedule)
    with pytest.raises(ConfigError, match="name"):
        beat.entry("", "t", 10)


@pytest.mark.parametrize(("call", "said"), [
    ({"args": (object(),)}, "cannot be encoded as JSON"),
    ({"args": (float("nan"),)}, "cannot be encoded as JSON"),
    ({"args": (b"raw",)}, "cannot be encoded as JSON"),
    ({"kwargs": {"to": "ops\x00@example.com"}}, "NUL character"),
    ({"kwargs": {1: "a"}}, "kwargs must be a mapping with text keys"),
    ({"args": 5}, "args must be a list or tuple"),
    ({"args": "ops@example.com"}, "args must be a list or tuple"),
    ({"task": 5}, "the task must be a task name"),
    ({"task": ""}, "the task must be a task name"),
    ({"priority": "high"}, "priority must be an integer"),
])
def test_a_periodic_task_no_tick_could_send_is_refused_when_declared(tasks: TaskApp, call: dict[str, Any],
                                                                     said: str) -> None:
    # Given a periodic task whose every tick would be refused (arguments no JSON or no column takes, no task
    # name, a property no broker encodes): found only at a tick, beat logged it each period and never ran it
    call = dict(call)
    task = call.pop("task", "enq.mail")
    # When it is declared; Then one ConfigError line names the entry and what is wrong, and no entry is added
    with pytest.raises(ConfigError, match=said) as e:
        tasks.outbox.periodic("bad-entry", task, EVERY_S, **call)
    assert "periodic task 'bad-entry'" in str(e.value) and "\n" not in str(e.value)
    assert "bad-entry" not in tasks.app.conf.beat_schedule
