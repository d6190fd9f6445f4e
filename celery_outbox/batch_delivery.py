"""Deliveries of a batch of messages to a batch consumer, decided without Celery.

``deliver_batch`` takes what a worker collected for one batch consumer and returns one ``Delivery`` per
message, in order, with the same meaning as ``delivery.deliver``'s: the caller acks PROCESSED and
DUPLICATE, redelivers RETRY after ``retry_in_s``, removes DEAD_LETTERED. The guarantee is per message:

- the first deliveries that parse run as ONE batch (``ConsumerSpec.handle_batch``: one claim statement,
  one handler call, one commit); nothing is counted for them up front, as for a first single delivery;
- a batch whose handler raises is rolled back and bisected: each half runs as a batch of its own, so the
  messages that do not fail are processed in this same pass, and a failure is never counted against a
  message because a neighbour failed. A message found to fail alone is delivered on its own through
  ``delivery.deliver``, which runs the handler once more (a list of one) and counts that delivery,
  retries it with the consumer's backoff and dead-letters it after its maximum deliveries, with its own
  error: exactly what a plain consumer does with it;
- a message that is not a first delivery (a Celery retry, or a broker redelivery after a worker died
  mid-batch) and a message that does not parse are delivered alone through ``delivery.deliver`` too,
  counted at its start. So a message that kills its worker is bounded by its own count, and the messages
  that came back with it are counted only when they run, one at a time, not for each kill.

See docs/tasks.md, "Batch consumers".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import Clock
from celery_outbox.consumer import ConsumerSpec
from celery_outbox.delivery import Delivery, deliver
from celery_outbox.errors import ConfigError, OutboxError
from celery_outbox.inbox.claim import CrashSite
from celery_outbox.messages import Envelope, MalformedDelivery
from celery_outbox.policy import Backoff
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings

__all__ = ["BatchItem", "deliver_batch"]


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


def _envelope(spec: ConsumerSpec, item: BatchItem, settings: Settings) -> Envelope | None:
    """The item's envelope when it is a well-formed message this consumer takes, else None (it goes alone)."""
    body = item.body
    if isinstance(body, str) and MalformedDelivery.decode(body) is not None:
        return None
    try:
        if isinstance(body, (str, bytes)) and len(body) > settings.max_message_bytes:
            return None
        envelope = Envelope.from_dict(body, max_depth=settings.max_json_depth)
    except (OutboxError, RecursionError):
        return None
    return envelope if spec.accepts(envelope.type) else None


def deliver_batch(sessions: sessionmaker[Session], spec: ConsumerSpec, items: Sequence[BatchItem], *, tables: Tables,
                  settings: Settings, clock: Clock, crash_points: CrashSite | None = None,
                  policy: Backoff | None = None) -> list[Delivery]:
    """Deliver ``items`` to batch consumer ``spec``: one ``Delivery`` per item, in order (module docstring)."""
    if spec.batch_handler is None:
        raise ConfigError(f"consumer {spec.name!r} is not a batch consumer (declare it with batch_size=...)")
    resolved = policy or spec.policy.resolve(settings)
    results: list[Delivery | None] = [None] * len(items)

    def alone(index: int) -> None:
        item = items[index]
        results[index] = deliver(sessions, spec, item.body, tables=tables, request_id=item.request_id,
                                 settings=settings, clock=clock, crash_points=crash_points,
                                 first_delivery=item.first_delivery, redelivered=item.redelivered, policy=resolved)

    batchable: list[tuple[int, Envelope]] = []
    for index, item in enumerate(items):
        envelope = _envelope(spec, item, settings) if item.fresh else None
        if envelope is not None:
            batchable.append((index, envelope))
    taken = {index for index, _ in batchable}

    def run(group: list[tuple[int, Envelope]]) -> None:
        try:
            with sessions() as session:
                outcomes = spec.handle_batch(session, [e for _, e in group], tables=tables, clock=clock,
                                             crash_points=crash_points)
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
        run(batchable)
    for index in range(len(items)):
        if index not in taken:
            alone(index)
    return [r for r in results if r is not None]
