"""The relay's SQL: due pending rows in seq order, served by the partial index ``ix_outbox_pending``."""

from __future__ import annotations

import sqlalchemy as sa

from celery_outbox.schema import OutboxRow, Tables


def due_pending(now_ms: int, limit: int, *, tables: Tables, skip_locked: bool = False) -> sa.Select[OutboxRow]:
    """Pending (not published, not dead-lettered) rows whose backoff has passed, oldest first.

    The WHERE clause repeats the partial index's predicate word for word so the planner can use it;
    with ``skip_locked`` (Postgres) concurrent relays claim disjoint rows.
    """
    stmt = (
        sa.select(tables.outbox)
        .where(
            tables.outbox.published_at_ms.is_(None),
            tables.outbox.dead_lettered_at_ms.is_(None),
            tables.outbox.next_attempt_at_ms <= now_ms,
        )
        .order_by(tables.outbox.seq)
        .limit(limit)
    )
    if skip_locked:
        stmt = stmt.with_for_update(skip_locked=True)
    return stmt
