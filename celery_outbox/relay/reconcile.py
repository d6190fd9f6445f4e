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

from celery_outbox import counters
from celery_outbox.clock import Clock
from celery_outbox.db import wrap_driver_errors
from celery_outbox.errors import BrokerUnavailableError, MessageTooLargeError, SerializationError
from celery_outbox.messages import Envelope, TaskMessage, celery_task_messages
from celery_outbox.relay.publisher import Publisher
from celery_outbox.schema import Tables

log = logging.getLogger("celery_outbox.relay.reconcile")

WATERMARK = "reconciled_through_ms"
RECONCILED = "reconciled"


@dataclass(kw_only=True)
class ReconcileResult:
    checked: int = 0  # published rows looked at in this pass
    republished: int = 0  # (message, consumer) pairs sent again
    watermark_ms: int = 0
    broker_unavailable: bool = False


def _watermark(session: Session, *, tables: Tables) -> int | None:
    value = session.execute(sa.select(tables.counters.value).where(
        tables.counters.consumer == counters.RELAY, tables.counters.name == WATERMARK)).scalar_one_or_none()
    return None if value is None else int(value)


def _set_watermark(session: Session, value: int, *, tables: Tables) -> None:
    row = session.get(tables.counters, (counters.RELAY, WATERMARK))
    if row is None:
        session.add(tables.counters(consumer=counters.RELAY, name=WATERMARK, value=value))
    else:
        row.value = value


def reconcile(session: Session, publisher: Publisher, clock: Clock, *, tables: Tables, routes: Mapping[str, Sequence[str]],
              namespace: str, max_message_bytes: int, older_than_ms: int, limit: int = 1000) -> ReconcileResult:
    """One pass; commits. The first pass ever only sets the watermark (history is not re-checked)."""
    upto = clock.now_ms() - older_than_ms
    result = ReconcileResult(watermark_ms=upto)
    with wrap_driver_errors("reconciling the outbox with the inbox"):
        since = _watermark(session, tables=tables)
        if since is None:
            _set_watermark(session, upto, tables=tables)
            session.commit()
            return result
        rows = session.execute(
            sa.select(tables.outbox.message_id, tables.outbox.type, tables.outbox.payload, tables.outbox.headers,
                      tables.outbox.created_at_ms, tables.outbox.published_at_ms)
            .where(tables.outbox.published_at_ms.is_not(None), tables.outbox.published_at_ms > since,
                   tables.outbox.published_at_ms <= upto)
            .order_by(tables.outbox.published_at_ms).limit(limit)
        ).all()
        result.checked = len(rows)
        if not rows:
            _set_watermark(session, upto, tables=tables)
            session.commit()
            return result
        ids = [r.message_id for r in rows]
        seen = {(m, c) for m, c in session.execute(sa.select(tables.inbox.message_id, tables.inbox.consumer)
                                                   .where(tables.inbox.message_id.in_(ids)))}
        seen |= {(m, c) for m, c in session.execute(sa.select(tables.parked.message_id, tables.parked.consumer)
                                                    .where(tables.parked.message_id.in_(ids)))}
        dead = {(m, c) for m, c in session.execute(
            sa.select(tables.dead_letters.message_id, tables.dead_letters.consumer)
            .where(tables.dead_letters.message_id.in_([str(i) for i in ids])))}
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
        _set_watermark(session, next_mark, tables=tables)
        counters.stage_increment(session, counters.RELAY, RECONCILED, len(messages), tables=tables)
        session.commit()
    result.republished = len(messages)
    result.watermark_ms = next_mark
    return result
