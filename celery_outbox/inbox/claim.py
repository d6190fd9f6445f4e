"""The inbox key: claiming ``(message_id, consumer)`` inside the effect's transaction, and the fast path.

Shared by ``handle`` (the plain path) and ``ordering`` (the per-entity path), so neither imports the other.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Protocol

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.orm import Session

from celery_outbox.clock import SystemClock
from celery_outbox.db import is_unique_violation, wrap_driver_errors
from celery_outbox.errors import DatabaseError
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from celery_outbox.sql import insert_for, upsert

Handler = Callable[[Session, Envelope], None]
"""The effect: write with the given session, never commit (the inbox commits)."""

Prepare = Callable[[Session, Envelope], None]
"""An external effect with an idempotency key, run before the inbox transaction opens."""

NOW_KEY = "outbox_consumer_now_ms"
DUPLICATES = "duplicates"


class CrashSite(Protocol):
    """What ``handle`` needs of ``celery_outbox.crashpoints.CrashPoints`` (tests pass a raising fake)."""

    def reached(self, name: str) -> None: ...


class DuplicateDelivery(Exception):
    """Internal signal: the inbox (or the parking lot) already holds this key. Never escapes handle()."""


def effect_now_ms(session: Session) -> int:
    """The instant of the delivery being handled, for handlers that stamp their rows."""
    value = session.info.get(NOW_KEY)
    return int(value) if value is not None else SystemClock().now_ms()


def already_seen(session: Session, message_id: uuid.UUID, consumer: str, *, tables: Tables) -> bool:
    """The fast path: a plain read. Correctness never depends on it."""
    stmt = sa.select(sa.literal(1)).where(tables.inbox.message_id == message_id, tables.inbox.consumer == consumer)
    with wrap_driver_errors(f"inbox lookup for {consumer}"):
        return session.execute(stmt).first() is not None


def claim(session: Session, envelope: Envelope, *, tables: Tables, consumer: str, now_ms: int) -> None:
    """INSERT the inbox row now (flushed), inside the caller's transaction.

    Raises ``DuplicateDelivery`` on a unique violation (SQLite or Postgres); on Postgres a parallel
    claim of the same key blocks here until the first transaction ends, then fails or proceeds.
    """
    stmt = insert_for(session, tables.inbox).values(
        message_id=envelope.message_id, consumer=consumer, type=envelope.type, processed_at_ms=now_ms,
    )
    try:
        session.execute(stmt)
    except exc.IntegrityError as e:
        if is_unique_violation(e):
            raise DuplicateDelivery(f"{envelope.message_id}/{consumer}") from None
        raise DatabaseError(f"inbox insert for {consumer} failed: {e.orig}") from e
    except exc.DBAPIError as e:
        raise DatabaseError(f"inbox insert for {consumer} failed: {e.orig}") from e


def claim_if_absent(session: Session, envelope: Envelope, *, tables: Tables, consumer: str, now_ms: int) -> bool:
    """Like ``claim`` but ``ON CONFLICT DO NOTHING``: True when this call inserted the row."""
    stmt = upsert(session, tables.inbox, {
        "message_id": envelope.message_id, "consumer": consumer, "type": envelope.type, "processed_at_ms": now_ms,
    }, keys=("message_id", "consumer"))
    with wrap_driver_errors(f"inbox insert for {consumer}"):
        result = session.execute(stmt)
    return bool(getattr(result, "rowcount", 0) == 1)
