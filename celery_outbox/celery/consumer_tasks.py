"""One Celery task per consumer, on its own queue; ``delivery.deliver`` decides, the task maps it onto Celery.

Returning acks the message (acks_late: only after the inbox commit). A delivery that must be
redelivered becomes ``self.retry`` with the consumer's backoff; Celery's retry is the redelivery loop,
the count in the database decides when it ends in the dead-letter store.

What each outcome looks like in Flower (every publish of a message has a task id of its own,
``messages.task_id``, so each delivery is its own entry): processed is SUCCESS with the result
``"processed"``; a duplicate is SUCCESS with ``"duplicate of <message_id>"`` plus the event
``outbox-duplicate-absorbed``; a dead letter raises ``DeadLettered`` (a ``Reject`` without requeue)
once the dead letter is committed: the worker records FAILURE with the reason, naming the dead letter
and its group (``task-failed``; a replay runs under the same task id, ``inbox.dead_letters.replay``) and
rejects the message, which removes it from the queue on RabbitMQ (``basic_reject``) and Redis (the
unacked entry is dropped), plus the event ``outbox-dead-lettered``. Events are sent under the
worker's node name (``events.task_sender``).

Every message for these tasks passes ``celery_outbox.celery.strategy.guarded`` (the task's
``Strategy``) first: in a worker the task receives the envelope as JSON text, or a
``MalformedDelivery`` for a broker message that was not a valid task message, never anything Celery
could choke on. Called eagerly (tests, ``apply``) it also takes the envelope as a dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery import Celery
from celery.exceptions import Reject

from celery_outbox import tracing
from celery_outbox.celery import batch_tasks, events
from celery_outbox.celery.config import consumer_time_limits
from celery_outbox.celery.strategy import STRATEGY
from celery_outbox.consumer import ConsumerSpec
from celery_outbox.delivery import Delivery, deliver
from celery_outbox.errors import MalformedMessageError
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import MALFORMED_PREFIX, decode_json, storable_text, task_name
from celery_outbox.policy import Backoff
from celery_outbox.runtime import Context
from celery_outbox.settings import Settings


def _body_ids(body: Any, max_depth: int) -> tuple[str, str | None]:
    """The (message_id, event type) a delivered body names, as far as it names them (storable, bounded)."""
    if isinstance(body, str) and not body.startswith(MALFORMED_PREFIX):
        try:
            body = decode_json(body, max_depth=max_depth)
        except MalformedMessageError:
            body = None
    raw = body.get("message_id") if isinstance(body, Mapping) else None
    message_id = storable_text(raw, limit=64) if isinstance(raw, str) else ""
    kind = body.get("type") if isinstance(body, Mapping) else None
    event_type = storable_text(kind, limit=200) if isinstance(kind, str) else None
    return message_id, event_type


class DeadLettered(Reject):
    """The delivery ended in the dead-letter store (committed): reject the message, never requeue it.

    Celery records a ``Reject(requeue=False)`` as FAILURE (``task-failed`` with this exception's repr:
    the reason Flower shows) and then rejects the broker message, so it is removed, not redelivered.
    Raised only after the dead letter is committed. The constructor keeps ``Reject``'s signature, so it
    pickles between the pool and the worker.
    """

    def __init__(self, reason: Any = None, requeue: bool = False) -> None:
        super().__init__(reason, requeue=False)  # type: ignore[no-untyped-call]

    def __repr__(self) -> str:
        return f"DeadLettered({self.reason!s})"

    def __str__(self) -> str:
        return str(self.reason)


def deliver_or_retry(task: Any, ctx: Context, spec: ConsumerSpec, body: Any, *, request_id: str | None,
                     settings: Settings, policy: Backoff, wrapper_levels: int = 0) -> Delivery:
    """``deliver`` for the running task's request; a delivery that must be redelivered raises Celery's
    retry with the policy's countdown instead of returning. Shared by consumer and idempotent tasks
    (``wrapper_levels``: see ``delivery.deliver``; a worker's message passed the gate, an eager call did not)."""
    try:
        request = task.request
        info = request.delivery_info or {}
        with tracing.worker_message(request):  # the span names the real queue (celery_outbox/tracing.py)
            result = deliver(ctx.sessions(), spec, body, tables=ctx.tables, request_id=request_id,
                             settings=settings, clock=ctx.clock, crash_points=ctx.crash_points,
                             first_delivery=not request.retries, redelivered=bool(info.get("redelivered")),
                             policy=policy, gated=wrapper_levels > 0 and not request.is_eager,
                             wrapper_levels=wrapper_levels)
    except Exception as e:  # never let a failure escape: acks_late would ack (and drop) the message
        result = Delivery(outcome=Outcome.RETRY, deliveries=0,
                          error=storable_text(f"{e.__class__.__name__}: {e}", limit=2000),
                          retry_in_s=policy.delay_s(1))
    if result.retry_in_s is not None:
        raise task.retry(countdown=result.retry_in_s, max_retries=None,
                         exc=RedeliveryError(result.error or "failed"))
    return result


def finish(task: Any, app: Celery, consumer: str, body: Any, result: Delivery, max_depth: int) -> str:
    """Map a finished delivery onto Celery: the task's result, or ``DeadLettered``; events best effort."""
    if result.outcome not in (Outcome.DUPLICATE, Outcome.DEAD_LETTERED):
        return str(result.outcome.value)
    message_id, event_type = _body_ids(body, max_depth)
    sender = events.task_sender(task)
    if result.outcome is Outcome.DUPLICATE:
        events.duplicate_absorbed(app, consumer=consumer, message_id=message_id, event_type=event_type, **sender)
        return f"duplicate of {message_id or 'an unnamed message'}"
    error = result.error or "no error recorded"
    events.dead_lettered(app, source="consumer", consumer=consumer, message_id=message_id, error=error,
                         event_type=event_type, attempts=result.deliveries, dead_letter=result.dead_letter,
                         group=result.group, **sender)
    # The dead letter and its group come before the error (which may be cut): what to replay, by id or group.
    where = f" as {result.dead_letter} (group {result.group})" if result.dead_letter else ""
    raise DeadLettered(storable_text(
        f"dead-lettered for {consumer} after {result.deliveries} deliveries{where}: {error}", limit=1000))


def define(app: Celery, ctx: Context, spec: ConsumerSpec) -> Any:
    """Define the task ``task_name(spec.name)`` on ``app`` and return it."""
    settings = ctx.settings
    soft_limit, hard_limit = consumer_time_limits(settings)  # a hard kill is requeued and counted (config.py)
    policy = spec.policy.resolve(settings)

    @app.task(  # type: ignore[untyped-decorator]
        name=task_name(spec.name), bind=True, acks_late=True,
        reject_on_worker_lost=True, ignore_result=True, max_retries=None, shared=False,
        time_limit=hard_limit, soft_time_limit=soft_limit, acks_on_timeout=False,
        # every broker message is checked before Celery unpacks it (strategy.py); a batch consumer's
        # messages then wait in a buffer and go to the pool a batch at a time (batch_tasks.py)
        Strategy=STRATEGY if spec.batch_size is None else batch_tasks.STRATEGY,
        outbox_settings=settings, outbox_queue=settings.queue_name(spec.name),  # read by the strategy
        outbox_max_eta_s=float(policy.max_s) + 60.0,
        outbox_batch_size=spec.batch_size, outbox_batch_wait_ms=spec.batch_wait_ms,
        outbox_batch_runner=batch_tasks.BatchRunner(ctx, spec, policy) if spec.batch_size is not None else None,
    )
    def run(self: Any, body: Any) -> str:
        result = deliver_or_retry(self, ctx, spec, body, request_id=self.request.id, settings=settings, policy=policy)
        return finish(self, app, spec.name, body, result, settings.max_json_depth)

    return run


class RedeliveryError(Exception):
    """Carries the failure text into Celery's retry log line (JSON-safe, no driver objects)."""
