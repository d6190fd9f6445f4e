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
WATERMARK_SEQ = "reconciled_through_seq"  # with the ms: a keyset, so rows sharing one ms are never skipped
RECONCILED = "reconciled"
_ALL = 2**63 - 1


@dataclass(kw_only=True)
class ReconcileResult:
    checked: int = 0  # published rows looked at in this pass
    republished: int = 0  # (message, consumer) pairs sent again
    watermark_ms: int = 0
    broker_unavailable: bool = False


def _counter(session: Session, name: str, *, tables: Tables) -> int | None:
    value = session.execute(sa.select(tables.counters.value).where(
        tables.counters.consumer == counters.RELAY, tables.counters.name == name)).scalar_one_or_none()
    return None if value is None else int(value)


def _watermark(session: Session, *, tables: Tables) -> tuple[int, int] | None:
    """(published_at_ms, seq) checked through; a watermark without its seq covers that whole ms."""
    ms = _counter(session, WATERMARK, tables=tables)
    if ms is None:
        return None
    seq = _counter(session, WATERMARK_SEQ, tables=tables)
    return ms, _ALL if seq is None else seq


def _put(session: Session, name: str, value: int, *, tables: Tables) -> None:
    row = session.get(tables.counters, (counters.RELAY, name))
    if row is None:
        session.add(tables.counters(consumer=counters.RELAY, name=name, value=value))
    else:
        row.value = value


def _set_watermark(session: Session, value: tuple[int, int], *, tables: Tables) -> None:
    _put(session, WATERMARK, value[0], tables=tables)
    _put(session, WATERMARK_SEQ, value[1], tables=tables)


def reconcile(session: Session, publisher: Publisher, clock: Clock, *, tables: Tables, routes: Mapping[str, Sequence[str]],
              namespace: str, max_message_bytes: int, older_than_ms: int, limit: int = 1000) -> ReconcileResult:
    """One pass; commits. The first pass ever only sets the watermark (history is not re-checked)."""
    upto = clock.now_ms() - older_than_ms
    result = ReconcileResult(watermark_ms=upto)
    with wrap_driver_errors("reconciling the outbox with the inbox"):
        since = _watermark(session, tables=tables)
        if since is None:
            _set_watermark(session, (upto, _ALL), tables=tables)
            session.commit()
            return result
        since_ms, since_seq = since
        published = tables.outbox.published_at_ms
        rows = session.execute(
            sa.select(tables.outbox.seq, tables.outbox.message_id, tables.outbox.type, tables.outbox.payload,
                      tables.outbox.headers, tables.outbox.created_at_ms, published)
            .where(published.is_not(None), published <= upto,
                   sa.or_(published > since_ms, sa.and_(published == since_ms, tables.outbox.seq > since_seq)))
            .order_by(published, tables.outbox.seq).limit(limit)
        ).all()
        result.checked = len(rows)
        if not rows:
            _set_watermark(session, (upto, _ALL), tables=tables)
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
            if (r.headers or {}).get("outbox_kind") == "task":
                continue  # an enqueued Celery task, not an event: no consumers to reconcile
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
        # A full page means more rows in the window: stop at the last (ms, seq) checked, never inside a ms.
        next_mark = (int(rows[-1].published_at_ms), int(rows[-1].seq)) if len(rows) == limit else (upto, _ALL)
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
    result.watermark_ms = next_mark[0]
    return result
