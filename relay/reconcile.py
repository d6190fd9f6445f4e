"""The reconciler: re-publish published events that some routed consumer never recorded.

The outbox says what was published, the inbox what each consumer committed, so together they can
see a message lost anywhere between the two: a broker that lost acknowledged data, kombu's Redis
transport dropping a message popped by a worker (or from a Redis server) that died before recording
it as unacked (docs/guarantees.md). Each pass looks at rows published in a window that ends
``older_than_ms`` ago and starts where the previous pass stopped (a watermark kept in
``consumer_counters``), so every published row is checked once, late enough that a healthy
consumer has long handled it. A (message, consumer) pair with no inbox row, no dead letter and no
parked copy is published again to that consumer only; the inbox absorbs it if it was merely slow.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import Session

from consumers.models import ConsumerCounter, ConsumerDeadLetter, InboxEntry, ParkedMessage
from orders.models import OutboxMessage
from outbox import counters
from outbox.clock import Clock
from outbox.db import wrap_driver_errors
from outbox.errors import BrokerUnavailableError, MessageTooLargeError, SerializationError
from outbox.messages import Envelope, TaskMessage, celery_task_messages
from relay.publisher import Publisher

log = logging.getLogger("relay.reconcile")

WATERMARK = "reconciled_through_ms"
RECONCILED = "reconciled"


@dataclass(kw_only=True)
class ReconcileResult:
    checked: int = 0  # published rows looked at in this pass
    republished: int = 0  # (message, consumer) pairs sent again
    watermark_ms: int = 0
    broker_unavailable: bool = False


def _watermark(session: Session) -> int | None:
    value = session.execute(sa.select(ConsumerCounter.value).where(
        ConsumerCounter.consumer == counters.RELAY, ConsumerCounter.name == WATERMARK)).scalar_one_or_none()
    return None if value is None else int(value)


def _set_watermark(session: Session, value: int) -> None:
    row = session.get(ConsumerCounter, (counters.RELAY, WATERMARK))
    if row is None:
        session.add(ConsumerCounter(consumer=counters.RELAY, name=WATERMARK, value=value))
    else:
        row.value = value


def reconcile(session: Session, publisher: Publisher, clock: Clock, *, routes: Mapping[str, Sequence[str]],
              namespace: str, max_message_bytes: int, older_than_ms: int, limit: int = 1000) -> ReconcileResult:
    """One pass; commits. The first pass ever only sets the watermark (history is not re-checked)."""
    upto = clock.now_ms() - older_than_ms
    result = ReconcileResult(watermark_ms=upto)
    with wrap_driver_errors("reconciling the outbox with the inbox"):
        since = _watermark(session)
        if since is None:
            _set_watermark(session, upto)
            session.commit()
            return result
        rows = session.execute(
            sa.select(OutboxMessage.message_id, OutboxMessage.type, OutboxMessage.payload, OutboxMessage.headers,
                      OutboxMessage.created_at_ms, OutboxMessage.published_at_ms)
            .where(OutboxMessage.published_at_ms.is_not(None), OutboxMessage.published_at_ms > since,
                   OutboxMessage.published_at_ms <= upto)
            .order_by(OutboxMessage.published_at_ms).limit(limit)
        ).all()
        result.checked = len(rows)
        if not rows:
            _set_watermark(session, upto)
            session.commit()
            return result
        ids = [r.message_id for r in rows]
        seen = {(m, c) for m, c in session.execute(sa.select(InboxEntry.message_id, InboxEntry.consumer)
                                                   .where(InboxEntry.message_id.in_(ids)))}
        seen |= {(m, c) for m, c in session.execute(sa.select(ParkedMessage.message_id, ParkedMessage.consumer)
                                                    .where(ParkedMessage.message_id.in_(ids)))}
        dead = {(m, c) for m, c in session.execute(
            sa.select(ConsumerDeadLetter.message_id, ConsumerDeadLetter.consumer)
            .where(ConsumerDeadLetter.message_id.in_([str(i) for i in ids])))}
        messages: list[TaskMessage] = []
        for r in rows:
            missing = [c for c in routes.get(r.type, ()) if (r.message_id, c) not in seen
                       and (str(r.message_id), c) not in dead]
            if not missing:
                continue
            envelope = Envelope(message_id=r.message_id, type=r.type, payload=r.payload,
                                headers=dict(r.headers or {}), created_at_ms=r.created_at_ms)
            try:
                messages.extend(celery_task_messages(envelope, targets=[(c, f"{namespace}.{c}") for c in missing],
                                                     max_bytes=max_message_bytes))
            except (SerializationError, MessageTooLargeError) as e:  # the relay published it, so unlikely
                log.warning("reconcile: cannot rebuild %s: %s", r.message_id, e)
        last = int(rows[-1].published_at_ms)
        # A full page means more rows in the window: stop the watermark at the last row checked.
        next_mark = last if len(rows) == limit else upto
        session.rollback()  # read-only so far; hold no locks across the publish
    if messages:
        try:
            publisher.publish_batch(messages)
        except BrokerUnavailableError as e:
            log.warning("reconcile: broker unavailable, will retry the same window: %s", e)
            result.broker_unavailable = True
            return result
        for m in messages:
            log.warning("reconcile: %s never reached %s; published again", m.properties["message_id"], m.consumer)
    with wrap_driver_errors("advancing the reconcile watermark"):
        _set_watermark(session, next_mark)
        counters.stage_increment(session, counters.RELAY, RECONCILED, len(messages))
        session.commit()
    result.republished = len(messages)
    result.watermark_ms = next_mark
    return result
