"""The relay's SQL: due pending rows in seq order, served by the partial index ``ix_outbox_pending``."""

from __future__ import annotations

import sqlalchemy as sa

from orders.models import OutboxMessage


def due_pending(now_ms: int, limit: int, *, skip_locked: bool = False) -> sa.Select[OutboxMessage]:
    """Pending (not published, not dead-lettered) rows whose backoff has passed, oldest first.

    The WHERE clause repeats the partial index's predicate word for word so the planner can use it;
    with ``skip_locked`` (Postgres) concurrent relays claim disjoint rows.
    """
    stmt = (
        sa.select(OutboxMessage)
        .where(
            OutboxMessage.published_at_ms.is_(None),
            OutboxMessage.dead_lettered_at_ms.is_(None),
            OutboxMessage.next_attempt_at_ms <= now_ms,
        )
        .order_by(OutboxMessage.seq)
        .limit(limit)
    )
    if skip_locked:
        stmt = stmt.with_for_update(skip_locked=True)
    return stmt
