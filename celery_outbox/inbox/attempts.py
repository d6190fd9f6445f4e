"""Deliveries per (message, consumer), counted in the database: a retry or a broker redelivery is
counted at its START, a first delivery only if it fails (delivery.py), so the happy path writes nothing here.

Celery's ``request.retries`` only counts ``self.retry``; a worker killed mid-task (OOM, SIGKILL) is
redelivered with the same count, and a message that kills its worker would loop for ever. Counting
before the work bounds every kind of redelivery, which is what makes ``task_reject_on_worker_lost``
safe here (a first delivery killed in its work comes back flagged ``redelivered`` and is counted
for both).
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox.db import wrap_driver_errors
from celery_outbox.schema import AttemptRow, Tables
from celery_outbox.sql import upsert


def begin(session: Session, *, tables: Tables, key: uuid.UUID, consumer: str, now_ms: int, uncounted: int = 0) -> AttemptRow:
    """Count this delivery (commits) and return the row; ``deliveries`` includes this one.

    ``uncounted``: earlier deliveries known to have happened without a row (a first delivery takes
    the fast path and is only counted when it fails; if its worker died instead, the broker's
    redelivered flag says so and it is counted here).
    """
    stmt = upsert(session, tables.attempts, {
        "message_id": key, "consumer": consumer, "deliveries": 1 + uncounted, "first_failed_at_ms": now_ms,
        "last_failed_at_ms": now_ms, "last_error": "",
    }, keys=("message_id", "consumer"), update={"deliveries": tables.attempts.deliveries + 1})
    # ONE statement: the upsert returns the row it wrote (an ORM upsert with RETURNING, Postgres and
    # SQLite >= 3.35), then the count commits before any work, so a worker killed in the work still counted.
    with wrap_driver_errors(f"counting a delivery for {consumer}"):
        row = session.scalars(stmt.returning(tables.attempts), execution_options={"populate_existing": True}).one()
        session.commit()
    return row


def fail(session: Session, row: AttemptRow, *, error: str, now_ms: int) -> None:
    """Stage the failure on ``row`` (the caller commits, possibly with a dead letter)."""
    if not row.last_error:
        row.first_failed_at_ms = now_ms
    row.last_failed_at_ms = now_ms
    row.last_error = error


def forget(session: Session, *, tables: Tables, key: uuid.UUID, consumer: str) -> None:
    """The delivery succeeded (or was absorbed): drop its count; commits."""
    with wrap_driver_errors(f"clearing the delivery count for {consumer}"):
        session.execute(sa.delete(tables.attempts).where(tables.attempts.message_id == key,
                                                         tables.attempts.consumer == consumer))
        session.commit()
