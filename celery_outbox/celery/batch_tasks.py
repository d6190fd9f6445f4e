"""A batch consumer on Celery: the worker collects its messages and hands the pool one batch at a time.

A batch consumer's task is an ordinary consumer task (``consumer_tasks.define``: same name, queue,
acks late, time limits, the gate of ``strategy.guarded``) with one more thing, its ``Strategy``
(``batching``): in the worker's main process each message that passed the gate becomes a Celery
``Request`` as usual, but instead of going to the pool alone it joins a buffer, which goes to the pool as
ONE job (``run_batch``) at once while a pool process is free for it, else when a batch of this consumer
finishes, when ``batch_size`` requests wait, or ``batch_wait_ms`` after the first, whichever comes first
(``_Buffer``): a trickle waits for nothing, and batches grow with the load. The job runs
``batch_delivery.deliver_batch_with`` in a pool process, under the consumer's time limits. Its results come
back to the main process, which then settles each message on its own:

- PROCESSED / DUPLICATE: acked (after the batch's commit: acks late, per message);
- RETRY: the pool process has already published the message again with its countdown and retry count,
  as Celery's ``Task.retry`` does; the original is acked. If that publish failed, the original is
  rejected with requeue (it comes back redelivered, and is counted);
- DEAD_LETTERED: rejected without requeue, after the dead letter's commit;
- the pool job itself lost (its process killed, a hard time limit): every message of the batch is
  rejected with requeue. If the whole worker dies, the broker redelivers every unacked message. Either
  way they come back flagged redelivered and run ONE AT A TIME, counted at their start
  (``batch_delivery``), so a message that kills its worker is dead-lettered by its own count.

A message with an ETA (a retry's countdown) never enters the buffer: Celery's timer hands it to the pool
alone, where the task runs it as a batch of one through ``delivery.deliver``, like any consumer's retry.

What Flower shows: one task per message, as for any consumer. Each message gets ``task-received`` (when it
is taken), ``task-started`` (when its batch goes to the pool) and then ``task-succeeded`` (its result is
``processed`` or ``duplicate of <message_id>``), ``task-retried`` or ``task-failed`` (dead-lettered, with
the reason); a batch lost with its pool process shows ``task-rejected`` (requeued) for each message. The
batch itself is not a task: ``outbox stats`` and the Prometheus metrics count batches and their sizes
(``counters.BATCHES``, ``counters.BATCHED_MESSAGES``).

Prefetch: a buffered message is unacked, so a worker holds at most ``concurrency x
worker_prefetch_multiplier`` of them; set the multiplier so that this is at least ``batch_size``, or
batches stop growing there (docs/tasks.md, "Batch consumers").
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery import current_app
from celery.worker.state import task_ready

from celery_outbox.batch_delivery import BatchItem, deliver_batch_with
from celery_outbox.celery import delayed_retry
from celery_outbox.celery.strategy import guarded
from celery_outbox.consumer import ConsumerSpec
from celery_outbox.delivery import Delivery, DeliveryContext
from celery_outbox.errors import MalformedMessageError
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import decode_json, storable_text
from celery_outbox.policy import Backoff
from celery_outbox.runtime import Context

log = logging.getLogger(__name__)

STRATEGY = "celery_outbox.celery.batch_tasks:batching"
_ID_DEPTH = 64  # the message id and type sit at the top of the envelope: a shallow bound reads them

__all__ = ["STRATEGY", "BatchRunner", "Settled", "batching", "run_batch"]


@dataclass(frozen=True)
class Settled:
    """What the pool made of one message of a batch (picklable: it crosses from the pool process)."""

    outcome: str
    deliveries: int
    error: str | None = None
    requeue: bool = False  # a retry whose new copy could not be published: reject with requeue instead
    dead_letter: str | None = None  # dead-lettered now: ``consumer:<id>`` and its group, named in Flower's FAILURE
    group: str | None = None


class BatchRunner:
    """``deliver_batch`` for one batch consumer, with its context and resolved policy (a task attribute;
    an object, not a function, so the task class does not bind it as a method)."""

    def __init__(self, ctx: Context, spec: ConsumerSpec, policy: Backoff) -> None:
        self.ctx, self.spec, self.policy = ctx, spec, policy
        self._context: DeliveryContext | None = None

    def context(self) -> DeliveryContext:
        """Built at the first batch (the tables may be defined late), or as the worker starts (celery/warmup.py)."""
        if self._context is None:
            ctx = self.ctx
            self._context = DeliveryContext.build(self.spec, tables=ctx.tables, settings=ctx.settings, clock=ctx.clock,
                                                  crash_points=ctx.crash_points, policy=self.policy)
        return self._context

    def __call__(self, items: Sequence[BatchItem]) -> list[Delivery]:
        # the worker's strategy gated every message (size, depth) before it entered the buffer
        return deliver_batch_with(self.context(), self.ctx.sessions(), items, gated=True)


def run_batch(task_name: str, items: list[BatchItem], retries: list[int]) -> list[Settled]:
    """The pool job of one batch (a module-level function: the prefork pool pickles a reference to it)."""
    task = current_app.tasks[task_name]
    runner: BatchRunner = task.outbox_batch_runner
    try:
        results = runner(items)
    except Exception as e:  # never let a failure escape: each message is requeued and counted when it comes back
        log.exception("outbox: batch of %s failed outside its deliveries", task_name)
        error = storable_text(f"{e.__class__.__name__}: {e}", limit=2000)
        return [Settled(outcome=Outcome.RETRY.value, deliveries=0, error=error, requeue=True) for _ in items]
    settled: list[Settled] = []
    for item, result, tries in zip(items, results, retries, strict=True):
        requeue = False
        if result.retry_in_s is not None:
            try:  # what Task.retry does: the same message again, its countdown, one more retry
                countdown, route = delayed_retry.queue_retry_options(  # quorum: the broker's delay chain
                    task.app, task.app.amqp.queues.get(getattr(task, "outbox_queue", None)), result.retry_in_s)
                task.apply_async(args=(item.body,), task_id=item.request_id, countdown=countdown,
                                 retries=tries + 1, **route)
            except Exception as e:
                log.warning("outbox: could not publish the retry of %s (%s); requeueing it", item.request_id, e)
                requeue = True
        settled.append(Settled(outcome=result.outcome.value, deliveries=result.deliveries, error=result.error,
                               requeue=requeue, dead_letter=result.dead_letter, group=result.group))
    return settled


class _Buffer:
    """The requests of one batch consumer waiting in a worker's main process (module docstring).

    A batch goes to the pool at once while fewer of this consumer's batches are running than the pool has
    processes: a trickle waits for nothing. While every process is busy, requests gather here, and go as
    one batch when a batch finishes, when ``batch_size`` of them are waiting, or ``batch_wait_ms`` after the
    first of them, whichever comes first: under load, batches grow by themselves."""

    def __init__(self, task: Any, consumer: Any) -> None:
        self.task, self.consumer = task, consumer
        self.size: int = task.outbox_batch_size
        self.wait_s: float = task.outbox_batch_wait_ms / 1000.0
        self.soft, self.hard = task.soft_time_limit, task.time_limit
        self.slots = max(1, int(getattr(consumer.pool, "num_processes", None) or 1))
        self.running = 0
        self.pending: list[Any] = []
        self.timer_entry: Any = None
        self.lock = threading.Lock()  # the solo and threads pools run the timer on a thread of its own

    def add(self, request: Any) -> None:
        with self.lock:
            self.pending.append(request)
            if len(self.pending) >= self.size or self.running < self.slots:
                batch = self._take()
            else:
                if self.timer_entry is None:
                    self.timer_entry = self.consumer.timer.call_after(self.wait_s, self.on_timer)
                return
        self._send(batch)

    def on_timer(self) -> None:
        with self.lock:
            self.timer_entry = None
            batch = self._take() if self.pending else []
        if batch:
            self._send(batch)

    def on_done(self) -> None:
        """A batch of this consumer finished (settled or lost): what waits goes now."""
        with self.lock:
            self.running -= 1
            batch = self._take() if self.pending else []
        if batch:
            self._send(batch)

    def _take(self) -> list[Any]:
        """The waiting requests, counted as one running batch (the caller sends them)."""
        batch, self.pending = self.pending, []
        self.running += 1
        if self.timer_entry is not None:
            with contextlib.suppress(Exception):  # an entry that already ran
                self.timer_entry.cancel()
            self.timer_entry = None
        return batch

    def _send(self, batch: list[Any]) -> None:
        items = [BatchItem(body=r.args[0] if r.args else None, request_id=r.id,
                           first_delivery=not r.request_dict.get("retries"),
                           redelivered=bool((r.delivery_info or {}).get("redelivered"))) for r in batch]
        retries = [int(r.request_dict.get("retries") or 0) for r in batch]
        started = time.monotonic()
        for r in batch:
            r.send_event("task-started")

        def settled(results: list[Settled]) -> None:
            try:
                _settle(batch, results, time.monotonic() - started)
            finally:
                self.on_done()

        def lost(exc_info: Any) -> None:
            try:
                _lost(batch, exc_info)
            finally:
                self.on_done()

        self.consumer.pool.apply_async(run_batch, args=(self.task.name, items, retries), callback=settled,
                                       error_callback=lost, soft_timeout=self.soft, timeout=self.hard)


def _message_id(request: Any) -> str:
    """The message id the request's envelope names ('' when it names none), storable."""
    body = request.args[0] if request.args else None
    try:
        decoded = decode_json(body, max_depth=_ID_DEPTH) if isinstance(body, (str, bytes)) else body
    except MalformedMessageError:
        return ""
    raw = decoded.get("message_id") if isinstance(decoded, Mapping) else None
    return storable_text(raw, limit=64) if isinstance(raw, str) else ""


def _settle(batch: list[Any], settled: list[Settled], runtime: float) -> None:
    """In the main process: ack, reject or requeue each message of a finished batch (module docstring)."""
    for request, result in zip(batch, settled, strict=True):
        try:
            if result.requeue:
                request.reject(requeue=True)
            elif result.outcome == Outcome.DEAD_LETTERED.value:
                # as consumer_tasks.finish: the dead letter and its group first (a replay runs under this task id)
                where = f" as {result.dead_letter} (group {result.group})" if result.dead_letter else ""
                reason = storable_text(f"dead-lettered for {request.task.name} after {result.deliveries} deliveries"
                                       f"{where}: {result.error or 'no error recorded'}", limit=1000)
                request.send_event("task-failed", exception=f"DeadLettered({reason})", traceback="")
                request.reject(requeue=False)
            elif result.outcome == Outcome.RETRY.value:
                request.send_event("task-retried", exception=f"RedeliveryError({result.error or 'failed'})",
                                   traceback="")
                request.acknowledge()
            else:
                value = result.outcome
                if value == Outcome.DUPLICATE.value:
                    value = f"duplicate of {_message_id(request) or 'an unnamed message'}"
                request.send_event("task-succeeded", result=repr(value), runtime=runtime)
                request.acknowledge()
        except Exception:  # pragma: no cover - one message's broker call must not leave the others unsettled
            log.exception("outbox: could not settle message %s of a batch", getattr(request, "id", "?"))
        finally:
            task_ready(request)


def _lost(batch: list[Any], exc_info: Any) -> None:
    """The batch's pool job died (killed process, hard time limit): every message goes back, requeued."""
    log.error("outbox: a batch of %d for %s was lost (%s); requeueing its messages", len(batch),
              batch[0].task.name if batch else "?", getattr(exc_info, "exception", exc_info))
    for request in batch:
        try:
            request.reject(requeue=True)
        except Exception:  # pragma: no cover
            log.exception("outbox: could not requeue message %s", getattr(request, "id", "?"))
        finally:
            task_ready(request)


class _Via:
    """The worker's consumer as Celery's default strategy sees it, with ``on_task_request`` (where a request
    without an ETA goes) pointed at the buffer; everything else is the consumer's own."""

    def __init__(self, consumer: Any, on_task_request: Callable[[Any], None]) -> None:
        self._consumer = consumer
        self.on_task_request = on_task_request

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def batching(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., Any]:
    """``Task.Strategy`` of batch consumer tasks: the consumer gate (``strategy.guarded``), then the buffer."""
    buffer = _Buffer(task, consumer)
    prefetch = getattr(consumer, "initial_prefetch_count", None)
    if isinstance(prefetch, int) and 0 < prefetch < buffer.size:  # 0: unlimited
        log.warning("outbox: consumer task %s batches up to %d messages, but this worker prefetches %d (concurrency x "
                    "worker_prefetch_multiplier): its batches stop at %d; raise worker_prefetch_multiplier "
                    "(docs/tasks.md, 'Batch consumers')", task.name, buffer.size, prefetch, prefetch)
    return guarded(task, app, _Via(consumer, buffer.add), **kwargs)
