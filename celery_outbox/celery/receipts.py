"""The worker side of task receipts (celery_outbox/inbox/receipts.py): which plain tasks reached a worker.

``Outbox`` adds ``receipt_step(outbox)`` to its app's worker boot steps, so every ``celery worker`` of
that app records receipts with no call of the user's; nothing is connected outside a worker. The
step connects two Celery signals, in the worker's main process, each for this app's tasks whose
message carries ``RECEIPT_HEADER`` (a plain task captured into the outbox; an ``@outbox.task`` has
its inbox row):

* ``task_received``: the receipt, kept pending in memory and written in batches (one autocommitted
  statement per batch on one connection the main process holds, ``receipts.BatchWriter``); a message
  with an ``eta`` is written at once (the worker holds it unacked until then, maybe for long);
* ``task_revoked`` (revoked or expired): written at once; the worker deliberately did not run it; the
  reconciler must not resurrect it.

Why the main process at receipt, in batches, and not the pool process before each task (as before,
``task_prerun``: one checkout, BEGIN, INSERT and COMMIT per task, the largest worker-side cost of a
captured plain task, docs/benchmarks.md): the receipt only has to exist before the broker forgets the
message. Until the worker acks (or rejects) it, the message is the broker's unacked message, and a
worker that dies hands it back (the library's late acks; RabbitMQ requeues it with the channel,
Redis restores it after the visibility timeout): it is received again and gets its receipt then. So
the rule is **a receipt is written before its message's ack or reject**: ``task_received`` wraps the
request's ack and reject callbacks, and an ack or reject of a request whose receipt is still pending
writes every pending receipt first (waiting for a batch already being written), then acks
(``flush``). A batch lost with a SIGKILLed worker holds only receipts of unacked messages, which come
back.

Who writes, and when: the worker's main loop is serial for the whole worker (it receives, hands work
to the pool and acks), so a receipt written on it by the ack delays every delivery behind it (a round
trip per handful of tasks; docs/benchmarks.md, "Task receipts off the worker's loop"). So
``task_received`` also wraps the request's ``on_accepted`` (a pool process took the task): from then
on the task runs, and one daemon thread of the main process ("celery-outbox-receipts", started at
the first receipt) writes every pending receipt in one batch while it does; by the ack the receipt is
written and the ack writes nothing. Receipts that arrive while a batch is written go in the next one.
A task acked early (Celery's default ``acks_late=False``) is acked in ``on_accepted`` itself, so its
receipt is still written by that ack, alone. A task that runs long must not wait for its ack either:
pending receipts are also written ``flush_after_s`` (1 s) after the first of them (the consumer's
timer wakes the thread), or at once when ``max_batch`` are pending or the message has an ``eta``;
none is written at worker shutdown (every pending one belongs to an unacked message that the broker
redelivers), where the thread is stopped and the held connection closed. ``background=False`` writes
on the caller's thread instead (the same batches, with the loop waiting).

A batch that cannot be written (the database is away) is logged and kept for the next flush after a
backoff (``retry_after_s``, doubling up to ``max_retry_after_s``), so a database outage does not stall
every ack of the worker's main loop on a connect timeout; the ack goes ahead and the task runs. The
cost of a receipt that is never written is that the reconciler sends the task once more after its
window (docs/guarantees.md). At most ``max_pending`` receipts wait (the oldest are dropped, logged).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from typing import Any

from celery import bootsteps, signals

from celery_outbox.db import is_disconnect
from celery_outbox.inbox import receipts
from celery_outbox.runtime import Context

log = logging.getLogger(__name__)

FLUSH_AFTER_S = 1.0
MAX_BATCH = 500
MAX_PENDING = 50_000
RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0
CLOSE_WAIT_S = 5.0


class Receipts:
    """Records receipts of ``outbox``'s plain outbox tasks (the signal handlers; module docstring)."""

    def __init__(self, outbox: Any, *, flush_after_s: float = FLUSH_AFTER_S, max_batch: int = MAX_BATCH,
                 max_pending: int = MAX_PENDING, retry_after_s: float = RETRY_AFTER_S,
                 max_retry_after_s: float = MAX_RETRY_AFTER_S, background: bool = True) -> None:
        self.outbox = outbox
        self.flush_after_s = flush_after_s
        self.max_batch = max_batch
        self.max_pending = max_pending
        self.retry_after_s = retry_after_s
        self.max_retry_after_s = max_retry_after_s
        self.background = background
        self._pending: dict[uuid.UUID, int] = {}  # task id -> received at (ms), oldest first
        self._lock = threading.RLock()  # the pending dict only: never held across a write
        self._write_lock = threading.RLock()  # one batch at a time; an ack waits here for the batch in flight
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_pid: int | None = None
        self._closing = False
        self._timer_armed = False
        self._retry_at = 0.0  # time.monotonic() before which a failed batch is not tried again
        self._backoff_s = 0.0
        self._writer: receipts.BatchWriter | None = None

    def wanted(self, task: Any, headers: Any) -> bool:
        """A task of this app, not an ``@outbox.task``, whose message asks for a receipt."""
        if task is None or getattr(task, "app", None) is not self.outbox.app:
            return False
        if getattr(task, "outbox_task_key", None):
            return False
        return receipts.wants_receipt({receipts.RECEIPT_HEADER: _get(headers, receipts.RECEIPT_HEADER)})

    @property
    def pending(self) -> int:
        """Receipts received and not written yet."""
        return len(self._pending)

    def add(self, task_id: Any) -> uuid.UUID | None:
        """Keep the receipt of ``task_id`` pending (written by the next ``flush``); its key, or None."""
        key = receipts.task_uuid(task_id)
        if key is None:
            return None
        ctx: Context = self.outbox
        with self._lock:
            self._pending.setdefault(key, ctx.clock.now_ms())
            if len(self._pending) > self.max_pending:
                dropped = len(self._pending) - self.max_pending
                for old in list(self._pending)[:dropped]:
                    del self._pending[old]
                log.warning("dropped %d unwritten task receipts (more than %d pending; the reconciler may send "
                            "those tasks again after OUTBOX_RELAY_RECONCILE_PLAIN_TASKS_AFTER_MS)",
                            dropped, self.max_pending)
        return key

    def record(self, task_id: Any) -> bool:
        """Write the receipt of ``task_id`` now (with any pending); False (logged) when it could not be."""
        if self.add(task_id) is None:
            return False
        return self.flush(force=True)

    def flush(self, *, force: bool = False) -> bool:
        """Write every pending receipt in one batch; True when none is left pending. Never raises.

        After a failed batch the next ones wait ``retry_after_s`` (doubling), unless ``force``. The
        write holds ``_write_lock`` only, so receipts keep arriving while it runs."""
        with self._write_lock:
            with self._lock:
                if not self._pending:
                    return True
                if not force and time.monotonic() < self._retry_at:
                    return False
                batch = dict(self._pending)
            written = self._write(batch)
            with self._lock:
                if written:
                    for key in batch:
                        self._pending.pop(key, None)
                    self._backoff_s = 0.0
                    self._retry_at = 0.0
                    return not self._pending
                self._backoff_s = min(self.max_retry_after_s, max(self.retry_after_s, 2 * self._backoff_s))
                self._retry_at = time.monotonic() + self._backoff_s
                return False

    def write_soon(self) -> None:
        """Have the pending receipts written off the caller's thread (the worker's main loop), or now
        without ``background``."""
        if not self.background:
            self.flush()
            return
        if self._closing:
            return
        self._start_thread()
        self._wake.set()

    def _start_thread(self) -> None:
        if self._thread is not None and self._thread_pid == os.getpid() and self._thread.is_alive():
            return
        ctx: Context = self.outbox
        # The session factory is built here, on the loop's thread, before the thread exists: billiard forks
        # pool processes from this thread, and a fork while another thread held the factory's lock would
        # leave that lock held in the child.
        try:
            ctx.sessions()
        except Exception as e:  # the thread's first batch meets it again, and logs it
            log.debug("task receipts: no session factory yet: %s: %s", type(e).__name__, e)
        with self._lock:
            if self._thread is not None and self._thread_pid == os.getpid() and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._run, name="celery-outbox-receipts", daemon=True)
            self._thread_pid = os.getpid()
            self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closing:
                return
            try:
                self.flush()
            except Exception:  # flush never raises; a bug here must not end the thread and leave acks to write
                log.exception("task receipts: a batch failed")

    def _write(self, batch: dict[uuid.UUID, int]) -> bool:
        ctx: Context = self.outbox
        try:
            if self._writer is None:
                self._writer = receipts.BatchWriter(tables=ctx.tables)
            try:
                self._writer.write(ctx.sessions(), batch)
            except Exception as e:  # a pooled connection that died unpinged (db.pre_ping_after_idle): once more
                if not is_disconnect(e):
                    raise
                self._writer.write(ctx.sessions(), batch)
        except Exception as e:
            log.warning("could not record the receipt of %d task(s), %s (kept for a later try; the reconciler may "
                        "send them again after OUTBOX_RELAY_RECONCILE_PLAIN_TASKS_AFTER_MS): %s: %s",
                        len(batch), ", ".join(str(k) for k in list(batch)[:3]), type(e).__name__, e)
            return False
        return True

    # -- before an ack or a reject -----------------------------------------------------------------
    def guard(self, request: Any, key: uuid.UUID) -> bool:
        """Make ``request``'s ack and reject write its pending receipt first; False when this Celery's
        request has no such callbacks to wrap (the caller then writes the receipt at once)."""
        try:
            ack, reject = request._on_ack, request._on_reject
        except AttributeError:
            return False
        if not (callable(ack) and callable(reject)):
            return False

        def on_ack(*args: Any, **kwargs: Any) -> Any:
            self.before_ack(key)
            return ack(*args, **kwargs)

        def on_reject(*args: Any, **kwargs: Any) -> Any:
            self.before_ack(key)
            return reject(*args, **kwargs)

        accepted = getattr(request, "on_accepted", None)

        def on_accepted(*args: Any, **kwargs: Any) -> Any:
            try:
                return accepted(*args, **kwargs) if callable(accepted) else None
            finally:
                if key in self._pending:  # the task runs now: its receipt is written while it does
                    self.write_soon()

        try:
            request._on_ack = on_ack
            request._on_reject = on_reject
        except AttributeError:
            return False
        with contextlib.suppress(AttributeError):  # no hook: the ack (or the timer) writes it, as without a thread
            request.on_accepted = on_accepted
        return True

    def before_ack(self, key: uuid.UUID) -> None:
        """The message of ``key`` is about to be acked or rejected: its receipt (and the other pending) now,
        after the batch in flight, which may hold it."""
        if key not in self._pending:
            return
        with self._write_lock:
            if key in self._pending and not self.flush() and key in self._pending:
                log.warning("task %s acked without its receipt (the database failed; the reconciler may send it "
                            "again after OUTBOX_RELAY_RECONCILE_PLAIN_TASKS_AFTER_MS)", key)

    def _arm(self, consumer: Any) -> None:
        """Write what is pending ``flush_after_s`` from now, on the consumer's timer (once at a time)."""
        with self._lock:
            if self._timer_armed:
                return
            timer = getattr(consumer, "timer", None)
            if timer is None:
                return
            self._timer_armed = True
        try:
            timer.call_after(self.flush_after_s, self._on_timer)
        except Exception:  # no timer to ask: the acks still write every receipt before they go out
            log.exception("could not schedule the task receipts' flush")
            with self._lock:
                self._timer_armed = False

    def _on_timer(self) -> None:
        with self._lock:
            self._timer_armed = False
        self.write_soon()

    # -- signal handlers ---------------------------------------------------------------------------
    def on_received(self, sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        if request is None:
            return
        if not self.wanted(getattr(request, "task", None), getattr(request, "request_dict", None)):
            return
        key = self.add(getattr(request, "id", None))
        if key is None:
            return
        if not self.guard(request, key) or getattr(request, "eta", None) or len(self._pending) >= self.max_batch:
            self.flush(force=True)
        if self._pending:
            self._arm(sender)

    def on_revoked(self, sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        if self.wanted(sender, request):
            self.record(_get(request, "id"))

    def close(self) -> None:
        """Stop the thread and close the connection the batches were written on (worker shutdown).

        Waits at most ``CLOSE_WAIT_S`` in all for a batch in flight (a database that does not answer must not
        hold the shutdown); the pending receipts belong to unacked messages, which come back."""
        self._closing = True
        self._wake.set()
        deadline = time.monotonic() + CLOSE_WAIT_S
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and self._thread_pid == os.getpid():
            thread.join(CLOSE_WAIT_S)
        if not self._write_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            log.warning("task receipts: a batch is still being written; its connection is left to the exit")
            return
        try:
            if self._writer is not None:
                self._writer.close()
        finally:
            self._write_lock.release()

    def connect(self) -> None:
        uid = f"celery_outbox.receipts.{id(self.outbox)}"
        signals.task_received.connect(self.on_received, weak=False, dispatch_uid=f"{uid}.received")
        signals.task_revoked.connect(self.on_revoked, weak=False, dispatch_uid=f"{uid}.revoked")


def _get(obj: Any, name: str) -> Any:
    """``name`` of a Celery request: a mapping (the message headers) or an object (a task's request,
    whose message headers are its attributes in a worker, and its ``headers`` under ``.apply()``)."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:
        headers = getattr(obj, "headers", None)
        if isinstance(headers, dict):
            value = headers.get(name)
    return value


def receipt_step(outbox: Any) -> type[bootsteps.Step]:
    """A worker boot step that connects ``outbox``'s receipt handlers in the worker's main process."""

    class OutboxReceipts(bootsteps.StartStopStep):
        def __init__(self, parent: Any, **kwargs: Any) -> None:
            self.receipts = Receipts(outbox)
            self.receipts.connect()
            super().__init__(parent, **kwargs)  # type: ignore[no-untyped-call]

        def stop(self, parent: Any) -> None:
            self.receipts.close()

        def terminate(self, parent: Any) -> None:
            self.receipts.close()

    return OutboxReceipts
