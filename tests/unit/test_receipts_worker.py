"""A plain outbox task's receipt is written by the worker's main process, in batches, and always before its
message is acked or rejected (celery_outbox/celery/receipts.py).

Real Celery ``Request`` objects (the worker's own class, as its strategy builds them) for messages of
tests/tasks/idempotent_app.py's tasks, SQLite, a manual clock; the ack and reject callbacks stand in
for the broker and look at the database at the moment they are called. ``taken_by_the_pool`` is what
the worker does when a pool process takes the task; from then on the receipts' thread writes.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery.worker.request import Request
from kombu.message import Message
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.celery.receipts import Receipts
from celery_outbox.clock import ManualClock
from celery_outbox.inbox import receipts
from celery_outbox.schema import Tables
from tests.tasks import idempotent_app as ia


@pytest.fixture
def built(tmp_home: Path, sqlite_url: str, sqlite_sessions: sessionmaker[Session], clock: ManualClock,
          tables: Tables, namespace: str) -> ia.TaskApp:
    app = ia.build_in_memory(home=tmp_home, database_url=sqlite_url, sessions=sqlite_sessions, clock=clock,
                             tables=tables, namespace=namespace)
    return app


class Timer:
    """The consumer's timer: what was scheduled, run when the test says."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, Callable[[], Any]]] = []

    def call_after(self, secs: float, fun: Callable[[], Any], *args: Any, **kwargs: Any) -> None:
        self.calls.append((secs, fun))

    def fire(self) -> None:
        calls, self.calls = self.calls, []
        for _, fun in calls:
            fun()


class Consumer:
    def __init__(self) -> None:
        self.timer = Timer()


def stored(sessions: sessionmaker[Session], tables: Tables) -> set[str]:
    with sessions() as s:
        return {str(t) for t in s.scalars(sa.select(tables.receipts.task_id))}


def request(task: Any, *, receipt: bool = True, eta: dt.datetime | None = None,
            on_ack: Callable[..., Any] | None = None, on_reject: Callable[..., Any] | None = None) -> Any:
    """The worker's Request for one message of ``task``, as Celery's strategy builds it."""
    task_id = str(uuid.uuid4())
    msg = task.app.amqp.as_task_v2(task_id, task.name, args=["k"], kwargs={}, eta=eta)
    headers = {**msg.headers, **({receipts.RECEIPT_HEADER: 1} if receipt else {})}
    message = Message(body=json.dumps(list(msg.body)).encode(), headers=headers, properties=dict(msg.properties),
                      content_type="application/json", content_encoding="utf-8", delivery_info={})
    return Request(message, app=task.app, task=task, on_ack=on_ack or (lambda *a: None),
                   on_reject=on_reject or (lambda *a: None))


def database_away() -> Any:
    """The outbox's session factory while the database is unreachable."""
    raise sa.exc.OperationalError("connect", {}, Exception("database unreachable"))


def taken_by_the_pool(req: Any) -> None:
    """The worker's accept callback: a pool process has taken the task and runs it now."""
    req.on_accepted(4242, time.monotonic())


def settled(check: Callable[[], bool], *, within_s: float = 10.0) -> bool:
    """``check`` became true before ``within_s`` (what the receipts' thread does, it does a moment later)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return check()


def counting(monkeypatch: pytest.MonkeyPatch, *, gate: threading.Event | None = None,
             entered: threading.Event | None = None) -> list[int]:
    """The sizes of the batches written from now on; each sets ``entered`` and waits for ``gate`` first
    when they are given."""
    batches: list[int] = []
    real = receipts.record_many

    def counted(session: Session, rows: Any, **kwargs: Any) -> int:
        if entered is not None:
            entered.set()
        if gate is not None:
            assert gate.wait(30), "the test never let the batch through"
        batches.append(len(rows))
        return real(session, rows, **kwargs)

    monkeypatch.setattr(receipts, "record_many", counted)
    return batches


def test_a_receipt_waits_in_memory_and_is_written_before_its_message_is_acked(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a worker's receipt handlers and a plain outbox task's message whose ack looks at the database
    handlers, consumer = Receipts(built.outbox), Consumer()
    seen_at_ack: list[set[str]] = []
    req = request(built.plain, on_ack=lambda *a: seen_at_ack.append(stored(sqlite_sessions, tables)))
    # When the worker receives it
    handlers.on_received(sender=consumer, request=req)
    # Then nothing is written yet (the broker still holds the message unacked), and a flush is scheduled
    assert stored(sqlite_sessions, tables) == set() and handlers.pending == 1
    assert [secs for secs, _ in consumer.timer.calls] == [handlers.flush_after_s]
    # When the task is acked
    req.acknowledge()
    # Then its receipt was in the database before the ack went out
    assert seen_at_ack == [{req.id}] and handlers.pending == 0


def test_a_rejected_message_has_its_receipt_written_first(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a received plain outbox task whose reject looks at the database
    handlers = Receipts(built.outbox)
    seen: list[set[str]] = []
    req = request(built.plain, on_reject=lambda *a: seen.append(stored(sqlite_sessions, tables)))
    handlers.on_received(sender=Consumer(), request=req)
    # When the worker rejects it (a Reject, a lost pool process)
    req.reject(requeue=False)
    # Then its receipt was written before
    assert seen == [{req.id}]


def test_receipts_received_together_are_written_in_one_batch_by_the_first_ack(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], tables: Tables,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given three plain outbox tasks received while none has finished (-c 3)
    batches = counting(monkeypatch)
    handlers = Receipts(built.outbox)
    reqs = [request(built.plain) for _ in range(3)]
    for req in reqs:
        handlers.on_received(sender=Consumer(), request=req)
    # When they are acked one after the other
    reqs[1].acknowledge()
    # Then the first ack wrote all three receipts in one batch, and the other acks wrote nothing
    assert stored(sqlite_sessions, tables) == {r.id for r in reqs}
    reqs[0].acknowledge()
    reqs[2].acknowledge()
    assert batches == [3]


def test_a_full_batch_is_written_without_waiting_for_an_ack(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given handlers that write at most two receipts at a time
    handlers = Receipts(built.outbox, max_batch=2)
    reqs = [request(built.plain) for _ in range(2)]
    # When two are received
    for req in reqs:
        handlers.on_received(sender=Consumer(), request=req)
    # Then both are written
    assert stored(sqlite_sessions, tables) == {r.id for r in reqs} and handlers.pending == 0


def test_a_task_that_runs_long_gets_its_receipt_from_the_timer_before_it_ends(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a plain outbox task received and still running (no ack for longer than the reconciler waits)
    handlers, consumer = Receipts(built.outbox), Consumer()
    req = request(built.plain)
    handlers.on_received(sender=consumer, request=req)
    assert stored(sqlite_sessions, tables) == set()
    # When the consumer's timer fires
    consumer.timer.fire()
    # Then its receipt is written, and the next receipt schedules the timer again
    assert settled(lambda: stored(sqlite_sessions, tables) == {req.id})
    handlers.on_received(sender=consumer, request=request(built.plain))
    assert len(consumer.timer.calls) == 1


def test_an_eta_task_and_a_revoked_one_are_recorded_at_once(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a plain outbox task with an eta (the worker holds it unacked until then) and one revoked
    handlers = Receipts(built.outbox)
    later = request(built.plain, eta=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))
    revoked = request(built.plain)
    # When the worker receives the first and revokes the second
    handlers.on_received(sender=Consumer(), request=later)
    handlers.on_revoked(sender=built.plain, request=revoked._context)
    # Then both receipts are written now, with no ack
    assert stored(sqlite_sessions, tables) == {later.id, revoked.id}


def test_only_a_plain_task_captured_by_the_outbox_gets_a_receipt(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given the receipt handlers of this outbox
    handlers = Receipts(built.outbox)
    # When a plain task with the outbox's header, one without it, and an @outbox.task with it are received and acked
    reqs = [request(built.plain), request(built.plain, receipt=False), request(built.record)]
    for req in reqs:
        handlers.on_received(sender=Consumer(), request=req)
        req.acknowledge()
    # Then only the first has a receipt (the @outbox.task has its inbox row instead)
    assert stored(sqlite_sessions, tables) == {reqs[0].id}


def test_with_the_database_away_the_ack_goes_ahead_and_the_receipt_is_written_once_it_is_back(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], tables: Tables,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given a received plain outbox task, and the database gone
    outbox = built.outbox
    handlers = Receipts(outbox, retry_after_s=0.0)
    acked: list[str] = []
    req = request(built.plain, on_ack=lambda *a: acked.append("ack"))
    handlers.on_received(sender=Consumer(), request=req)
    real = outbox.sessions
    outbox.sessions = database_away  # type: ignore[assignment]
    try:
        # When the task is acked
        req.acknowledge()
    finally:
        outbox.sessions = real
    # Then the ack went out anyway, the failure is logged, and the receipt is still pending
    assert acked == ["ack"] and "could not record the receipt" in caplog.text and handlers.pending == 1
    # And the next flush, with the database back, writes it
    assert handlers.flush() is True
    assert stored(sqlite_sessions, tables) == {req.id}


def test_after_a_failed_batch_the_next_ones_wait_for_the_backoff(built: ia.TaskApp) -> None:
    # Given handlers whose last batch failed (a database that does not answer)
    class Broken:
        calls = 0

        def __call__(self) -> Any:
            Broken.calls += 1
            raise sa.exc.OperationalError("connect", {}, Exception("timed out"))

    outbox = built.outbox
    handlers = Receipts(outbox, retry_after_s=3600.0)
    real = outbox.sessions
    outbox.sessions = Broken()  # type: ignore[assignment]
    try:
        assert handlers.record(str(uuid.uuid4())) is False
        tried = Broken.calls
        # When more tasks are received and acked within the backoff
        for _ in range(3):
            req = request(built.plain)
            handlers.on_received(sender=Consumer(), request=req)
            req.acknowledge()
        # Then none of them waited on the database (each ack would have stalled the worker's main loop)
        assert Broken.calls == tried and handlers.pending == 4
    finally:
        outbox.sessions = real


def test_receipts_are_written_while_their_tasks_run_so_the_acks_write_nothing(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], tables: Tables,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given two plain outbox tasks received (-c 2), each ack looking at the database
    batches = counting(monkeypatch)
    handlers = Receipts(built.outbox)
    seen_at_ack: list[set[str]] = []
    reqs = [request(built.plain, on_ack=lambda *a: seen_at_ack.append(stored(sqlite_sessions, tables)))
            for _ in range(2)]
    for req in reqs:
        handlers.on_received(sender=Consumer(), request=req)
    assert stored(sqlite_sessions, tables) == set()
    # When a pool process takes the first
    taken_by_the_pool(reqs[0])
    # Then both receipts are written while it runs, in one batch, off the caller's thread
    assert settled(lambda: handlers.pending == 0)
    assert stored(sqlite_sessions, tables) == {r.id for r in reqs} and batches == [2]
    # And when the second is taken and both are acked, nothing more is written, each receipt already there
    taken_by_the_pool(reqs[1])
    for req in reqs:
        req.acknowledge()
    assert batches == [2] and seen_at_ack == [{r.id for r in reqs}] * 2
    handlers.close()


def test_the_loop_does_not_wait_for_a_batch_in_flight_but_the_ack_does(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], tables: Tables,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a received task taken by the pool, whose receipt's batch hangs in a slow database
    gate, entered = threading.Event(), threading.Event()
    batches = counting(monkeypatch, gate=gate, entered=entered)
    handlers = Receipts(built.outbox)
    seen_at_ack: list[set[str]] = []
    first = request(built.plain, on_ack=lambda *a: seen_at_ack.append(stored(sqlite_sessions, tables)))
    handlers.on_received(sender=Consumer(), request=first)
    taken_by_the_pool(first)
    assert entered.wait(10)
    # When the worker's loop receives and hands out the next task meanwhile
    second = request(built.plain)
    handlers.on_received(sender=Consumer(), request=second)
    taken_by_the_pool(second)
    # Then it did not wait for the batch (the gate is still shut), and the new receipt waits for the next one
    assert batches == [] and handlers.pending == 2
    # When the first task is acked while its batch is still in flight
    acking = threading.Thread(target=first.acknowledge)
    acking.start()
    acking.join(0.2)
    assert seen_at_ack == []  # the ack waits for the batch that holds its receipt
    gate.set()
    acking.join(30)
    # Then the ack went out after its receipt was written
    assert seen_at_ack and first.id in seen_at_ack[0]
    assert settled(lambda: handlers.pending == 0) and stored(sqlite_sessions, tables) == {first.id, second.id}
    handlers.close()


def test_a_receipt_the_thread_could_not_write_is_written_by_its_ack(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], tables: Tables,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given a received task taken by the pool while the database is away
    outbox = built.outbox
    handlers = Receipts(outbox, retry_after_s=0.0)
    seen_at_ack: list[set[str]] = []
    req = request(built.plain, on_ack=lambda *a: seen_at_ack.append(stored(sqlite_sessions, tables)))
    handlers.on_received(sender=Consumer(), request=req)
    real = outbox.sessions
    outbox.sessions = database_away  # type: ignore[assignment]
    try:
        taken_by_the_pool(req)
        assert settled(lambda: "could not record the receipt" in caplog.text)
    finally:
        outbox.sessions = real
    assert handlers.pending == 1
    # When the database is back and the task is acked
    req.acknowledge()
    # Then the ack wrote the receipt before it went out
    assert seen_at_ack == [{req.id}] and handlers.pending == 0
    handlers.close()


def test_closing_stops_the_thread_and_leaves_pending_receipts_to_redelivery(
        built: ia.TaskApp, sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given handlers whose thread has written a batch, and one receipt pending
    handlers = Receipts(built.outbox)
    first = request(built.plain)
    handlers.on_received(sender=Consumer(), request=first)
    taken_by_the_pool(first)
    assert settled(lambda: handlers.pending == 0)
    thread = handlers._thread
    handlers.on_received(sender=Consumer(), request=request(built.plain))
    # When the worker shuts down
    handlers.close()
    # Then the thread has ended and the pending receipt was not written (its message is unacked and comes back)
    assert thread is not None and not thread.is_alive()
    assert stored(sqlite_sessions, tables) == {first.id} and handlers.pending == 1
