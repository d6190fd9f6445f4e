"""The relay's deploy hold (celery_outbox/workers.py, docs/scheduled.md "Deploys"): a task row that a live
registered worker of its queue cannot run is held, charging no attempt, and goes out once every live worker
of the queue runs it; a queue with no live registered worker is never held for (no registry: no stall).

SQLite and Postgres (``any_sessions``); the relay is ``celery_outbox.testing.drain`` (in-memory publisher) on
the outbox's ``ManualClock``; the registry is written with the functions the worker's boot step calls.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import ManualClock, Tables, workers
from celery_outbox.celery.registry_step import task_versions
from celery_outbox.ops import stats as ops_stats
from celery_outbox.relay.dispatch import hold_from_settings
from celery_outbox.settings import Settings
from celery_outbox.testing import drain
from tests.tasks.test_enqueue import TaskApp

T0_MS = 1_900_000_000_000
RECHECK_MS = 2_000


@pytest.fixture
def tasks(any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> TaskApp:
    clock.set(T0_MS)
    return TaskApp(any_sessions, clock, tables, f"hold-{uuid.uuid4().hex[:8]}", worker_heartbeat_ms=1_000,
                   relay_hold_recheck_ms=RECHECK_MS)


def a_worker(tasks: TaskApp, clock: ManualClock, runs: dict[str, int], *, queue: str | None = None) -> uuid.UUID:
    worker = uuid.uuid4()
    with tasks.sessions() as s:
        workers.register(s, worker=worker, name="w@host", queues=[queue or tasks.queue], tasks=runs,
                         now_ms=clock.now_ms(), tables=tasks.tables)
    return worker


def send(tasks: TaskApp, task: Any, *args: Any) -> str:
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        return str(task.delay(*args).id)


def row(tasks: TaskApp, task_id: str) -> Any:
    [r] = [r for r in tasks.rows() if str(r.message_id) == task_id]
    return r


def test_no_live_registry_holds_nothing(tasks: TaskApp, clock: ManualClock) -> None:
    # Given no worker registered, or only one that stopped heartbeating 3 heartbeats ago, or one of another queue
    a_worker(tasks, clock, {"other.task": 1})
    clock.advance(3_001)
    a_worker(tasks, clock, {"other.task": 1}, queue="elsewhere")
    # When a task is sent and the relay runs, Then it goes out at once (a relay never stalls without a registry)
    task_id = send(tasks, tasks.mail, "a@example.com")
    assert [m.headers["id"] for m in drain(tasks.outbox).published] == [task_id]


def test_a_task_no_live_worker_runs_is_held_without_an_attempt_then_goes_out(tasks: TaskApp, clock: ManualClock,
                                                                           tables: Tables) -> None:
    # Given a live worker of the queue that runs enq.step only
    old = a_worker(tasks, clock, {"enq.step": 1})
    # When enq.mail is sent and the relay runs many times
    task_id = send(tasks, tasks.mail, "a@example.com")
    for _ in range(20):
        assert drain(tasks.outbox).published == []
        clock.advance(RECHECK_MS)
        with tasks.sessions() as s:
            workers.heartbeat(s, worker=old, now_ms=clock.now_ms(), tables=tables)
    # Then it is pending, held for the worker it waits for, with no attempt charged and no dead letter
    r = row(tasks, task_id)
    assert (r.published_at_ms, r.dead_lettered_at_ms, r.attempts) == (None, None, 0)
    assert r.held_for == f"waiting for a worker that runs enq.mail on queue {tasks.queue}"
    with tasks.sessions() as s:
        st = ops_stats.collect(s, tables=tables, clock=clock)
    assert [(w.what, w.count) for w in st.waiting_for_worker] == [(f"enq.mail on queue {tasks.queue}", 1)]
    assert st.scheduled == 0 and st.retrying == 0
    # When a worker that runs it starts beside the old one, Then it still waits (the old one could take it)
    a_worker(tasks, clock, {"enq.step": 1, "enq.mail": 1})
    clock.advance(RECHECK_MS)
    assert drain(tasks.outbox).published == []
    # When the old worker leaves, Then it goes out, once
    with tasks.sessions() as s:
        workers.unregister(s, worker=old, tables=tables)
    clock.advance(RECHECK_MS)
    assert [m.headers["id"] for m in drain(tasks.outbox).published] == [task_id]
    assert drain(tasks.outbox).published == []


def test_a_changed_task_version_waits_for_workers_of_that_version(tasks: TaskApp, clock: ManualClock) -> None:
    # Given enq.mail at version 2 in the enqueuing process, and a live worker running it at version 1
    tasks.mail.outbox_task_version = 2
    a_worker(tasks, clock, {"enq.mail": 1, "enq.step": 1})
    v2 = send(tasks, tasks.mail, "a@example.com")
    v1 = send(tasks, tasks.step, 1)  # unversioned: version 1
    assert row(tasks, v2).headers[workers.VERSION_HEADER] == 2 and workers.VERSION_HEADER not in row(tasks, v1).headers
    # When the relay runs, Then the version-1 task goes out and the version-2 one waits
    assert [m.headers["id"] for m in drain(tasks.outbox).published] == [v1]
    assert row(tasks, v2).held_for == f"waiting for a worker that runs enq.mail v2 on queue {tasks.queue}"
    # When the only live worker runs version 2 (or later), Then it goes out
    clock.advance(3_001)  # the version-1 worker expires (3 missed heartbeats); the held row is due again
    a_worker(tasks, clock, {"enq.mail": 3})
    assert [m.headers["id"] for m in drain(tasks.outbox).published] == [v2]


def test_events_are_never_held_and_heartbeat_zero_turns_the_hold_off(tasks: TaskApp, clock: ManualClock) -> None:
    assert hold_from_settings(Settings(worker_heartbeat_ms=0)) is None
    a_worker(tasks, clock, {"enq.step": 1})
    tasks.outbox.settings = tasks.outbox.settings.replace(worker_heartbeat_ms=0)
    task_id = send(tasks, tasks.mail, "a@example.com")
    assert [m.headers["id"] for m in drain(tasks.outbox).published] == [task_id]


def test_the_registered_task_table_leaves_out_celery_and_library_tasks(tasks: TaskApp) -> None:
    tasks.step.outbox_task_version = 4
    table = task_versions(tasks.app)
    # (other test modules' @shared_task functions join every app, so only these are checked)
    assert (table["enq.mail"], table["enq.step"]) == (1, 4)
    assert "celery_outbox.drain" in tasks.app.tasks and "celery.chord" in tasks.app.tasks
    assert not [n for n in table if n.startswith(("celery.", "celery_outbox."))]


def test_prune_deletes_only_long_dead_workers(tasks: TaskApp, clock: ManualClock, tables: Tables) -> None:
    a_worker(tasks, clock, {"enq.step": 1})
    clock.advance(30 * 1_000)
    fresh = a_worker(tasks, clock, {"enq.step": 1})
    with tasks.sessions() as s:
        assert workers.prune(s, clock.now_ms() + 1, heartbeat_ms=1_000, tables=tables) == 1
        assert s.execute(sa.select(tables.workers.id)).scalars().all() == [fresh]


def test_an_unreadable_registry_holds_nothing_and_never_stalls_the_relay(tasks: TaskApp, clock: ManualClock,
                                                                        tables: Tables,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    # Given a live worker that does not run enq.mail, and a registry the relay cannot read (code deployed
    # before the migration): its table renamed away
    a_worker(tasks, clock, {"enq.step": 1})
    table = tables.table(tables.workers).name
    engine = tasks.sessions.kw["bind"]
    with engine.begin() as c:
        c.exec_driver_sql(f"ALTER TABLE {table} RENAME TO {table}_away")
    try:
        # When enq.mail is sent and the relay runs
        task_id = send(tasks, tasks.mail, "a@example.com")
        # Then it goes out (nothing held, the claim intact), and the relay says why
        assert [m.headers["id"] for m in drain(tasks.outbox).published] == [task_id]
        assert row(tasks, task_id).published_at_ms is not None
        assert "the worker registry cannot be read" in caplog.text
    finally:
        with engine.begin() as c:
            c.exec_driver_sql(f"ALTER TABLE {table}_away RENAME TO {table}")


def test_the_worker_heartbeat_registers_refreshes_prunes_and_unregisters(tasks: TaskApp, clock: ManualClock,
                                                                         tables: Tables) -> None:
    from celery_outbox.celery.registry_step import Heartbeat

    # Given a row of a worker killed long ago (30 heartbeats and more)
    a_worker(tasks, clock, {"enq.step": 1})
    clock.advance(31_000)
    w = tables.workers

    def rows() -> list[Any]:
        with tasks.sessions() as s:
            return list(s.execute(sa.select(w.name, w.tasks, w.heartbeat_at_ms)).all())

    # When a worker starts, Then it is registered with its queues and tasks, and the dead row is gone
    beat = Heartbeat(tasks.outbox, hostname="celery@new")
    beat.interval_s = 3_600  # the thread never beats during the test; beats are called by hand
    beat.start()
    try:
        [(name, table, at)] = rows()
        assert name == "celery@new" and table["enq.mail"] == 1 and at == clock.now_ms()
        # When it beats later, Then its row is refreshed
        clock.advance(1_000)
        beat.beat()
        assert rows()[0][2] == clock.now_ms()
        # When its row was removed (by hand), Then the next beat registers it again
        with tasks.sessions() as s:
            s.execute(sa.delete(w))
            s.commit()
        beat.beat()
        beat.beat()
        assert len(rows()) == 1
    finally:
        beat.stop()
    # Then a warm stop leaves no row
    assert rows() == []


def test_a_worker_without_the_registry_table_says_in_one_line_what_to_run(tasks: TaskApp, tables: Tables,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Given a worker whose database has no registry table (the migrations not run), When it beats,
    Then its warning is one line that names `outbox db upgrade`: it carried the driver's SQL over several lines
    every heartbeat and never said what to do."""
    from celery_outbox.celery.registry_step import Heartbeat

    table = tables.table(tables.workers).name
    engine = tasks.sessions.kw["bind"]
    with engine.begin() as c:
        c.exec_driver_sql(f"ALTER TABLE {table} RENAME TO {table}_away")
    try:
        beat = Heartbeat(tasks.outbox, hostname="celery@new")
        with caplog.at_level(logging.WARNING, logger="celery_outbox.celery.registry_step"):
            beat.beat()
        [record] = [r for r in caplog.records if r.name == "celery_outbox.celery.registry_step"]
        message = record.getMessage()
        assert "\n" not in message, message
        assert message.endswith("(the outbox tables are missing: run `outbox db upgrade`)"), message
    finally:
        with engine.begin() as c:
            c.exec_driver_sql(f"ALTER TABLE {table}_away RENAME TO {table}")
