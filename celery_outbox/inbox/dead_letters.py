"""The consumer dead-letter store: what a consumer gave up on, for a person to list, inspect,
replay or purge.

The raw body text is kept, so even a message that was never valid JSON is not lost. Replay sends the
stored envelope back to its consumer's queue; the inbox still guards it (rule 8), so replaying a
message that did get processed after all is a harmless DUPLICATE.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox import counters
from celery_outbox.clock import Clock
from celery_outbox.db import wrap_driver_errors
from celery_outbox.errors import NotFoundError, ValidationError
from celery_outbox.schema import DeadLetterRow, Tables

Send = Callable[[str, dict[str, Any]], None]
"""``send(consumer, envelope_dict)``: enqueue the envelope on that consumer's queue."""


def record(session: Session, *, tables: Tables, consumer: str, message_id: str, type: str | None, body: str,
           headers: Mapping[str, Any], delivery_count: int, last_error: str, first_failed_at_ms: int,
           last_failed_at_ms: int) -> DeadLetterRow:
    """Stage a dead letter in ``session`` (the caller commits, together with whatever gave up)."""
    row = tables.dead_letters(
        consumer=consumer, message_id=message_id[:64], type=(type or None) and type[:200], body=body,
        headers=dict(headers), delivery_count=delivery_count, last_error=last_error,
        first_failed_at_ms=first_failed_at_ms, last_failed_at_ms=last_failed_at_ms, replayed_at_ms=None,
    )
    session.add(row)
    session.flush()
    counters.stage_increment(session, consumer, counters.DEAD_LETTERED, tables=tables)
    return row


def check_consumer(consumer: str, known_consumers: Iterable[str] | None) -> None:
    if known_consumers is None:
        return
    known = list(known_consumers)
    if consumer not in known:
        raise NotFoundError(f"unknown consumer {consumer!r}; configured consumers: {', '.join(known) or '(none)'}")


def list_dead_letters(session: Session, *, tables: Tables, consumer: str | None = None, include_replayed: bool = False,
                      known_consumers: Iterable[str] | None = None) -> list[DeadLetterRow]:
    """Dead letters, oldest first; by default only those not replayed yet."""
    if consumer is not None:
        check_consumer(consumer, known_consumers)
    stmt = sa.select(tables.dead_letters).order_by(tables.dead_letters.id)
    if consumer is not None:
        stmt = stmt.where(tables.dead_letters.consumer == consumer)
    if not include_replayed:
        stmt = stmt.where(tables.dead_letters.replayed_at_ms.is_(None))
    with wrap_driver_errors("listing consumer dead letters"):
        return list(session.execute(stmt).scalars().all())


def get(session: Session, id: int, *, tables: Tables) -> DeadLetterRow:
    with wrap_driver_errors(f"reading dead letter {id}"):
        row = session.get(tables.dead_letters, id)
    if row is None:
        raise NotFoundError(f"no consumer dead letter with id {id}")
    return row


def is_open(session: Session, *, tables: Tables, consumer: str, message_id: str) -> bool:
    """True when an unreplayed dead letter for (consumer, message_id) exists."""
    stmt = sa.select(sa.literal(1)).where(
        tables.dead_letters.consumer == consumer, tables.dead_letters.message_id == message_id[:64],
        tables.dead_letters.replayed_at_ms.is_(None),
    )
    return session.execute(stmt).first() is not None


def envelope_of(row: DeadLetterRow) -> dict[str, Any]:
    """The stored body as the dict to send again; a body that never was an object cannot be replayed."""
    try:
        body = json.loads(row.body)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ValidationError(
            f"dead letter {row.id} ({row.consumer}) is not an envelope object, so it cannot be replayed "
            f"as-is; inspect its body and purge it"
        )
    return body


def _forget_attempts(session: Session, *, tables: Tables, consumer: str, message_id: str) -> None:
    try:
        key = uuid.UUID(message_id)
    except ValueError:
        return
    session.execute(sa.delete(tables.attempts).where(tables.attempts.message_id == key,
                                                     tables.attempts.consumer == consumer))


def replay(session: Session, id: int, *, tables: Tables, send: Send, clock: Clock,
           known_consumers: Iterable[str] | None = None) -> DeadLetterRow:
    """Send dead letter ``id`` back to its consumer and mark it replayed; commits.

    The delivery count starts afresh (the replayed message gets the full number of deliveries).
    Order: forget the count, send, then mark; a crash after the send costs at most a second replay,
    which the inbox absorbs.
    """
    row = get(session, id, tables=tables)
    check_consumer(row.consumer, known_consumers)
    envelope = envelope_of(row)
    with wrap_driver_errors(f"replaying dead letter {id}"):
        _forget_attempts(session, tables=tables, consumer=row.consumer, message_id=row.message_id)
        session.commit()
    send(row.consumer, envelope)
    with wrap_driver_errors(f"marking dead letter {id} replayed"):
        row.replayed_at_ms = clock.now_ms()
        session.commit()
    return row


def purge(session: Session, ids: Sequence[int], *, tables: Tables) -> int:
    """Delete these dead letters (all or none: an unknown id changes nothing); commits; returns the count."""
    wanted = sorted(set(ids))
    if not wanted:
        return 0
    with wrap_driver_errors("purging consumer dead letters"):
        rows = session.execute(sa.select(tables.dead_letters).where(tables.dead_letters.id.in_(wanted))).scalars().all()
        missing = sorted(set(wanted) - {r.id for r in rows})
        if missing:
            session.rollback()
            raise NotFoundError(f"no consumer dead letter with id(s) {', '.join(map(str, missing))}; nothing purged")
        for row in rows:
            _forget_attempts(session, tables=tables, consumer=row.consumer, message_id=row.message_id)
            session.delete(row)
        session.commit()
    return len(rows)
