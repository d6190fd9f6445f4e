"""The reconciler covers tasks: ``@outbox.task`` rows like events (their inbox row), plain tasks by receipt.

SQLite, the in-memory publisher and a manual clock: the tasks are enqueued through a real Outbox
(tests/tasks/idempotent_app.py: ``idem.record`` is an ``@outbox.task``, ``plain.record`` a plain
``@app.task``), published by the relay's own ``dispatch_batch``, then "lost" (never delivered).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import counters
from celery_outbox.celery.receipts import Receipts
from celery_outbox.clock import ManualClock
from celery_outbox.counters import RECONCILED_PLAIN_TASKS, RECONCILED_TASKS
from celery_outbox.inbox import receipts
from celery_outbox.inbox.task_keys import task_key
from celery_outbox.ops import metrics, stats
from celery_outbox.relay.dispatch import dispatch_batch
from celery_outbox.relay.reconcile import ReconcileResult, reconcile
from celery_outbox.schema import Tables
from celery_outbox.testing.memory import InMemoryPublisher
from tests.tasks import idempotent_app as ia

AFTER = 40_000
PLAIN_AFTER = 600_000


@pytest.fixture
def built(tmp_home: Path, sqlite_url: str, sqlite_sessions: sessionmaker[Session], clock: ManualClock,
          tables: Tables, namespace: str) -> ia.TaskApp:
    app = ia.build_in_memory(home=tmp_home, database_url=sqlite_url, sessions=sqlite_sessions, clock=clock,
                             tables=tables, namespace=namespace)
    ia.metadata.create_all(sqlite_sessions.kw["bind"])
    return app


def run(built: ia.TaskApp, sessions: sessionmaker[Session], clock: ManualClock, pub: InMemoryPublisher,
        tables: Tables, *, plain_after: int = PLAIN_AFTER) -> ReconcileResult:
    with sessions() as s:
        return reconcile(s, pub, clock, tables=tables, routes={}, namespace=built.settings.namespace,
                         max_message_bytes=1_000_000, older_than_ms=AFTER,
                         idempotent_tasks=built.outbox.idempotent_tasks(), plain_older_than_ms=plain_after)


def enqueue(built: ia.TaskApp, sessions: sessionmaker[Session], task: Any, *keys: str) -> list[str]:
    ids = []
    with sessions() as s, built.outbox.transaction(s):
        for key in keys:
            ids.append(task.delay(key).id)
        s.commit()
    return ids


def publish(built: ia.TaskApp, sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> InMemoryPublisher:
    pub = InMemoryPublisher()
    with sessions() as s:
        dispatch_batch(s, pub, clock, tables=tables, batch_size=100, max_attempts=3, base_delay_ms=1000,
                       max_delay_ms=10_000, routes={}, max_message_bytes=1_000_000, namespace=built.settings.namespace)
    return pub


def test_an_outbox_task_with_no_inbox_row_is_sent_again_with_its_task_id(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given a reconciler that has run once, and three @outbox.task calls the relay published
    assert run(built, sqlite_sessions, clock, InMemoryPublisher(), tables).republished == 0
    clock.advance(1_000)
    ran, lost, dead = enqueue(built, sqlite_sessions, built.record, "ran", "lost", "dead")
    first = publish(built, sqlite_sessions, clock, tables)
    sent = {m.message_id: m for m in first.published}
    # And a broker that delivered one (it ran: its inbox row exists), lost one, and one was dead-lettered
    built.record.apply(args=["ran"], task_id=ran)
    with sqlite_sessions() as s:
        s.add(tables.dead_letters(consumer=task_key(ia.RECORD), message_id=dead, type=ia.RECORD, body="[]",
                                  headers={}, delivery_count=3, last_error="x", first_failed_at_ms=0,
                                  last_failed_at_ms=0))
        s.commit()
    # When the reconciler passes before its window ends, nothing is sent; after it, only the lost one
    pub = InMemoryPublisher()
    clock.advance(AFTER // 2)
    assert run(built, sqlite_sessions, clock, pub, tables).republished == 0
    clock.advance(AFTER)
    result = run(built, sqlite_sessions, clock, pub, tables)
    assert (result.checked, result.republished, result.tasks, result.events) == (3, 1, 1, 0)
    # Then it is the very message the relay sent: same task id, queue, arguments (the inbox would absorb a double)
    [again] = pub.published
    original = sent[lost]
    assert again.headers["id"] == lost and again.headers["task"] == ia.RECORD
    assert (again.exchange, again.routing_key, json.loads(again.body)) == (
        original.exchange, original.routing_key, json.loads(original.body))
    # And it was counted, shown in stats and metrics; the next pass sends nothing
    with sqlite_sessions() as s:
        st = stats.collect(s, tables=tables, clock=clock)
    assert st.reconciled == {"total": 1, "events": 0, "tasks": 1, "plain_tasks": 0}
    assert st.counters[counters.RELAY][RECONCILED_TASKS] == 1
    text = metrics.render(metrics.make_registry(tables=tables, session_factory=sqlite_sessions, clock=clock)).decode()
    assert 'outbox_relay_reconciled_total{kind="tasks"} 1.0' in text
    clock.advance(AFTER)
    assert run(built, sqlite_sessions, clock, pub, tables).republished == 0


def test_a_plain_task_is_sent_again_only_without_a_receipt_and_only_after_its_own_window(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given a reconciler that has run once, and two plain tasks the relay published
    run(built, sqlite_sessions, clock, InMemoryPublisher(), tables)
    clock.advance(1_000)
    started, lost = enqueue(built, sqlite_sessions, built.plain, "started", "lost")
    first = publish(built, sqlite_sessions, clock, tables)
    assert all(m.headers[receipts.RECEIPT_HEADER] == 1 for m in first.published)  # each asks for a receipt
    # And a worker that started one of them (its receipt)
    assert Receipts(built.outbox).record(started)
    # When the events window has passed, a plain task is not sent yet (it may merely be queued)
    pub = InMemoryPublisher()
    clock.advance(AFTER * 2)
    assert run(built, sqlite_sessions, clock, pub, tables).republished == 0
    # Then after the plain-task window, the one without a receipt is, with its task id
    clock.advance(PLAIN_AFTER)
    result = run(built, sqlite_sessions, clock, pub, tables)
    assert (result.plain_checked, result.plain_tasks, result.republished) == (2, 1, 1)
    assert [m.headers["id"] for m in pub.published] == [lost]
    with sqlite_sessions() as s:
        assert stats.collect(s, tables=tables, clock=clock).counters[counters.RELAY][RECONCILED_PLAIN_TASKS] == 1
    # And the next pass sends nothing
    clock.advance(PLAIN_AFTER)
    assert run(built, sqlite_sessions, clock, pub, tables).republished == 0


def test_with_the_plain_window_off_a_lost_plain_task_is_never_sent_again(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    run(built, sqlite_sessions, clock, InMemoryPublisher(), tables, plain_after=0)
    clock.advance(1_000)
    enqueue(built, sqlite_sessions, built.plain, "lost")
    publish(built, sqlite_sessions, clock, tables)
    pub = InMemoryPublisher()
    clock.advance(10 * PLAIN_AFTER)
    result = run(built, sqlite_sessions, clock, pub, tables, plain_after=0)
    assert (result.republished, result.plain_watermark_ms) == (0, None) and pub.published == []


def test_a_process_with_the_plain_window_off_beside_one_with_it_on_is_logged_every_time(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given a pass with the plain-task window on (it leaves a watermark)
    run(built, sqlite_sessions, clock, InMemoryPublisher(), tables)
    caplog.clear()
    # When a process with it off runs a pass, Then it resets the watermark and says so
    clock.advance(1_000)
    run(built, sqlite_sessions, clock, InMemoryPublisher(), tables, plain_after=0)
    assert [r.levelname for r in caplog.records if "plain-task reconcile is off" in r.message] == ["WARNING"]
    # And a second pass with it off has nothing to reset and says nothing
    caplog.clear()
    clock.advance(1_000)
    run(built, sqlite_sessions, clock, InMemoryPublisher(), tables, plain_after=0)
    assert not [r for r in caplog.records if "plain-task reconcile is off" in r.message]
    # And when the other process runs again with it on, the next pass with it off says so again
    run(built, sqlite_sessions, clock, InMemoryPublisher(), tables)
    run(built, sqlite_sessions, clock, InMemoryPublisher(), tables, plain_after=0)
    assert [r.levelname for r in caplog.records if "plain-task reconcile is off" in r.message] == ["WARNING"]


def test_a_receipt_the_database_refuses_is_logged_and_the_task_still_runs(
        built: ia.TaskApp, clock: ManualClock, caplog: pytest.LogCaptureFixture) -> None:
    # Given an outbox whose database is gone
    class Broken:
        def __call__(self) -> Any:
            raise sa.exc.OperationalError("connect", {}, Exception("database unreachable"))

    outbox = built.outbox
    handlers = Receipts(outbox)
    real = outbox.sessions
    outbox.sessions = Broken()  # type: ignore[assignment]
    try:
        # When the receipt is written, it fails without raising
        assert handlers.record(str(uuid.uuid4())) is False
    finally:
        outbox.sessions = real
    assert "could not record the receipt" in caplog.text


def test_a_plain_window_shorter_than_the_events_window_waits_for_the_events_window(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given a plain-task window set below the events window, and a published plain task with no receipt
    run(built, sqlite_sessions, clock, InMemoryPublisher(), tables, plain_after=AFTER // 4)
    clock.advance(1_000)
    [lost] = enqueue(built, sqlite_sessions, built.plain, "lost")
    publish(built, sqlite_sessions, clock, tables)
    # When the shorter window has passed but not the events window, nothing is sent
    pub = InMemoryPublisher()
    clock.advance(AFTER // 2)
    assert run(built, sqlite_sessions, clock, pub, tables, plain_after=AFTER // 4).republished == 0
    # Then after the events window it is
    clock.advance(AFTER)
    assert run(built, sqlite_sessions, clock, pub, tables, plain_after=AFTER // 4).plain_tasks == 1
    assert [m.headers["id"] for m in pub.published] == [lost]


def test_the_standalone_relay_reconciles_tasks_and_hands_what_it_resent_to_its_callback(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables,
        tmp_home: Path) -> None:
    from celery_outbox.relay.loop import RelayLoop

    # Given the standalone relay's loop of this app (its @outbox.task names passed in, like its routes)
    pub = InMemoryPublisher()
    announced: list[ReconcileResult] = []
    loop = RelayLoop(settings=built.settings, tables=tables, session_factory=sqlite_sessions, publisher=pub,
                     clock=clock, routes={}, listen=False, idempotent_tasks=built.outbox.idempotent_tasks(),
                     on_reconcile=announced.append)
    try:
        assert loop.reconcile_if_due() is not None and announced == []  # the first pass starts the watermarks
        # When an @outbox.task it published is lost and the window passes
        clock.advance(1_000)
        [lost] = enqueue(built, sqlite_sessions, built.record, "lost")
        assert loop.drain_once().published == 1
        clock.advance(built.settings.relay_reconcile_after_ms + int(built.settings.relay_reconcile_interval_s * 1000))
        result = loop.reconcile_if_due()
        # Then it is sent again and handed to the callback (the CLI's sends it to Flower as an event)
        assert result is not None and result.tasks == 1 and loop.stats.reconciled == 1
        assert [(r.kind, r.message_id, r.target) for a in announced for r in a.resent] == [("task", lost, ia.RECORD)]
    finally:
        loop.close()


def test_tasks_still_queued_behind_a_backlog_are_never_sent_again_and_lost_ones_are_once_it_drains(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given a reconciler that has run once, and an @outbox.task and a plain task the relay published while
    # their workers are stopped: the broker holds both, waiting in their queue
    pub = InMemoryPublisher()
    run(built, sqlite_sessions, clock, pub, tables)
    clock.advance(1_000)
    [idem] = enqueue(built, sqlite_sessions, built.record, "idem")
    [plain] = enqueue(built, sqlite_sessions, built.plain, "plain")
    first = publish(built, sqlite_sessions, clock, tables)
    queues = {m.queue.name if m.queue is not None else m.routing_key for m in first.published}
    for queue in queues:
        pub.queues.set(queue, ready=len(first.published), unacked=())
    # When the reconciler passes every interval for twice the plain-task window
    for _ in range(2 * PLAIN_AFTER // 5_000):
        clock.advance(5_000)
        run(built, sqlite_sessions, clock, pub, tables)
    # Then neither is sent again: both were late, neither was lost
    assert pub.published == []
    # And when their queue turns out empty with neither recorded (taken and lost), both are sent again, once
    for queue in queues:
        pub.queues.set(queue, ready=0, unacked=())
    clock.advance(5_000)
    result = run(built, sqlite_sessions, clock, pub, tables)
    assert (result.tasks, result.plain_tasks) == (1, 1)
    assert sorted(m.headers["id"] for m in pub.published) == sorted([idem, plain])
    clock.advance(5_000)
    assert run(built, sqlite_sessions, clock, pub, tables).republished == 0
