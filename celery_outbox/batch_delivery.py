"""Deliveries of a batch of messages to a batch consumer, decided without Celery.

``deliver_batch`` takes what a worker collected for one batch consumer and returns one ``Delivery`` per
message, in order, with the same meaning as ``delivery.deliver_with``'s: the caller acks PROCESSED and
DUPLICATE, redelivers RETRY after ``retry_in_s``, removes DEAD_LETTERED. The guarantee is per message:

- the first deliveries that parse run as ONE batch (``ConsumerSpec.handle_batch``: one claim statement,
  one handler call, one commit); nothing is counted for them up front, as for a first single delivery;
- a batch whose handler raises is rolled back and bisected: each half runs as a batch of its own, so the
  messages that do not fail are processed in this same pass, and a failure is never counted against a
  message because a neighbour failed. A message found to fail alone is delivered on its own through
  ``delivery.deliver_with``, which runs the handler once more (a list of one) and counts that delivery,
  retries it with the consumer's backoff and dead-letters it after its maximum deliveries, with its own
  error: exactly what a plain consumer does with it;
- a message that is not a first delivery (a Celery retry, or a broker redelivery after a worker died
  mid-batch) and a message that does not parse are delivered alone through ``delivery.deliver_with`` too,
  counted at its start. So a message that kills its worker is bounded by its own count, and the messages
  that came back with it are counted only when they run, one at a time, not for each kill.

See docs/tasks.md, "Batch consumers".
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import tracing
from celery_outbox.clock import Clock
from celery_outbox.consumer import ConsumerSpec
from celery_outbox.delivery import Body, Delivery, DeliveryContext, deliver_with, parse_body, parse_envelope
from celery_outbox.errors import ConfigError, OutboxError
from celery_outbox.inbox.claim import CrashSite
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.policy import Backoff
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings

__all__ = ["BatchItem", "deliver_batch", "deliver_batch_with"]


@dataclass(frozen=True, kw_only=True)
class BatchItem:
    """One message of a batch as the worker took it: its body, task id and delivery flags (as for ``deliver``)."""

    body: Any
    request_id: str | None = None
    first_delivery: bool = True
    redelivered: bool = False

    @property
    def fresh(self) -> bool:
        """A first delivery (no retry, no broker redelivery): it may run in a batch, uncounted."""
        return self.first_delivery and not self.redelivered


def _envelope(context: DeliveryContext, body: Body, gated: bool) -> Envelope | None:
    """The body's envelope when it is a well-formed message this consumer takes, else None (it goes alone,
    where ``deliver_with`` meets the same error and counts it)."""
    try:
        return parse_envelope(context, body, gated)
    except (OutboxError, RecursionError):
        return None


def deliver_batch(sessions: sessionmaker[Session], spec: ConsumerSpec, items: Sequence[BatchItem], *, tables: Tables,
                  settings: Settings, clock: Clock, crash_points: CrashSite | None = None,
                  policy: Backoff | None = None, gated: bool = False) -> list[Delivery]:
    """``deliver_batch_with`` on a ``DeliveryContext`` built for this call."""
    context = DeliveryContext.build(spec, tables=tables, settings=settings, clock=clock, crash_points=crash_points,
                                    policy=policy)
    return deliver_batch_with(context, sessions, items, gated=gated)


def deliver_batch_with(context: DeliveryContext, sessions: sessionmaker[Session], items: Sequence[BatchItem], *,
                       gated: bool = False) -> list[Delivery]:
    """Deliver ``items`` to the context's batch consumer: one ``Delivery`` per item, in order (module docstring).

    Each body is parsed once (``delivery.parse_body``); a message that goes alone hands that parse to
    ``deliver_with``. ``gated``: the messages passed the worker's gate (their size is checked)."""
    spec = context.spec
    if spec.batch_handler is None:
        raise ConfigError(f"consumer {spec.name!r} is not a batch consumer (declare it with batch_size=...)")
    bodies = [parse_body(item.body, max_depth=context.settings.max_json_depth) for item in items]
    results: list[Delivery | None] = [None] * len(items)

    def alone(index: int) -> None:
        item = items[index]
        results[index] = deliver_with(context, sessions, bodies[index], request_id=item.request_id,
                                      first_delivery=item.first_delivery, redelivered=item.redelivered, gated=gated)

    batchable: list[tuple[int, Envelope]] = []
    for index, item in enumerate(items):
        envelope = _envelope(context, bodies[index], gated) if item.fresh else None
        if envelope is not None:
            batchable.append((index, envelope))
    taken = {index for index, _ in batchable}

    def run(group: list[tuple[int, Envelope]]) -> None:
        try:
            with sessions() as session:
                outcomes = spec.handle_batch(session, [e for _, e in group], tables=context.tables,
                                             clock=context.clock, crash_points=context.crash_points)
        except Exception:  # rolled back (handle_batch): split, so the messages that do not fail go through now
            if len(group) == 1:
                alone(group[0][0])  # on its own: counted, retried, dead-lettered as a plain consumer's
                return
            middle = len(group) // 2
            run(group[:middle])
            run(group[middle:])
            return
        for (index, _), outcome in zip(group, outcomes, strict=True):
            results[index] = Delivery(outcome=outcome, deliveries=1)

    if batchable:
        # One CONSUMER span per message, open over its batch (each continues the trace its envelope carries; the
        # messages of a batch are linked to one another); a message that goes alone also gets its own delivery's.
        with contextlib.ExitStack() as spans:
            opened = [(index, spans.enter_context(tracing.consuming(
                consumer=spec.name, destination=context.destination, message_id=str(envelope.message_id),
                event_type=envelope.type, headers=envelope.headers))) for index, envelope in batchable]
            run(batchable)
            for index, span in opened:
                result = results[index]
                if result is not None:
                    span.record(result.outcome.value, deliveries=result.deliveries, error=result.error,
                                failed=result.outcome in (Outcome.RETRY, Outcome.DEAD_LETTERED))
    for index in range(len(items)):
        if index not in taken:
            alone(index)
    return [r for r in results if r is not None]
