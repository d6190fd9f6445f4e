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

from collections.abc import Callable
from typing import Any

from celery import Celery
from celery.exceptions import Reject
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import tracing
from celery_outbox.celery import batch_tasks, delayed_retry, events
from celery_outbox.celery.config import consumer_time_limits
from celery_outbox.celery.strategy import STRATEGY
from celery_outbox.consumer import ConsumerSpec
from celery_outbox.delivery import Body, Delivery, DeliveryContext, deliver_with, parse_body
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import storable_text, task_name
from celery_outbox.policy import Backoff
from celery_outbox.runtime import Context


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


def context_source(ctx: Context, spec: ConsumerSpec, *, policy: Backoff,
                   wrapper_levels: int = 0) -> Callable[[], DeliveryContext]:
    """The ``DeliveryContext`` of ``spec`` on ``ctx``, built at the first delivery (the tables may be
    declared after the task is: ``define_tables``) and rebuilt only if ``ctx``'s tables, clock or crash
    points are replaced (tests swap them between deliveries; a deployment never does)."""
    built: list[tuple[tuple[object, object, object], DeliveryContext]] = []

    def context() -> DeliveryContext:
        key = (ctx.tables, ctx.clock, ctx.crash_points)
        if built:
            (tables, clock, crash_points), current = built[0]
            if tables is key[0] and clock is key[1] and crash_points is key[2]:
                return current
        current = DeliveryContext.build(spec, tables=ctx.tables, settings=ctx.settings, clock=ctx.clock,
                                        crash_points=ctx.crash_points, policy=policy, wrapper_levels=wrapper_levels)
        built[:] = [(key, current)]
        return current

    return context


def deliver_or_retry(task: Any, sessions: Callable[[], sessionmaker[Session]], context: DeliveryContext, body: Body, *,
                     request_id: str | None) -> Delivery:
    """``deliver_with`` for the running task's request; a delivery that must be redelivered raises Celery's
    retry with the policy's countdown instead of returning. Shared by consumer and idempotent tasks
    (a worker's message passed the gate when the context wraps arguments, an eager call did not:
    ``DeliveryContext.wrapper_levels``)."""
    policy = context.policy
    try:
        request = task.request
        info = request.delivery_info or {}
        with tracing.worker_message(request):  # the span names the real queue (celery_outbox/tracing.py)
            result = deliver_with(context, sessions(), body, request_id=request_id,
                                  first_delivery=not request.retries, redelivered=bool(info.get("redelivered")),
                                  gated=context.wrapper_levels > 0 and not request.is_eager)
    except Exception as e:  # never let a failure escape: acks_late would ack (and drop) the message
        result = Delivery(outcome=Outcome.RETRY, deliveries=0,
                          error=storable_text(f"{e.__class__.__name__}: {e}", limit=2000),
                          retry_in_s=policy.delay_s(1))
    if result.retry_in_s is not None:  # on a quorum queue the wait is the broker's (celery/delayed_retry.py)
        countdown, route = delayed_retry.retry_options(task, result.retry_in_s)
        raise task.retry(countdown=countdown, max_retries=None, exc=RedeliveryError(result.error or "failed"),
                         **route)
    return result


def finish(task: Any, app: Celery, consumer: str, body: Body, result: Delivery) -> str:
    """Map a finished delivery onto Celery: the task's result, or ``DeadLettered``; events best effort."""
    if result.outcome not in (Outcome.DUPLICATE, Outcome.DEAD_LETTERED):
        return str(result.outcome.value)
    message_id, event_type = body.ids()
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
    max_depth = settings.max_json_depth
    context = context_source(ctx, spec, policy=policy)

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
        outbox_context=staticmethod(context),  # built ahead of the first message by celery/warmup.py
    )
    def run(self: Any, body: Any) -> str:
        parsed = parse_body(body, max_depth=max_depth)
        result = deliver_or_retry(self, ctx.sessions, context(), parsed, request_id=self.request.id)
        return finish(self, app, spec.name, parsed, result)

    return run


class RedeliveryError(Exception):
    """Carries the failure text into Celery's retry log line (JSON-safe, no driver objects)."""
