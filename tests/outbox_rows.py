"""Pending outbox rows for relay tests, written straight to the table (no order, no writer checks)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.schema import Tables

Payload = Callable[[int, uuid.UUID], Any]


def insert_pending(sessions: sessionmaker[Session], now_ms: int, n: int = 1, *, tables: Tables,
                   type_: str = "OrderPlaced", payload: Payload = lambda i, mid: {"order_id": f"o-{i}"},
                   headers: Callable[[uuid.UUID], dict[str, Any]] = lambda mid: {}) -> list[uuid.UUID]:
    """``n`` due rows of ``tables.outbox`` in seq order; returns their message ids in that order."""
    ids = [uuid.uuid4() for _ in range(n)]
    with sessions() as s:
        for i, mid in enumerate(ids):
            s.add(tables.outbox(message_id=mid, type=type_, payload=payload(i, mid), headers=headers(mid),
                                created_at_ms=now_ms, next_attempt_at_ms=now_ms, attempts=0))
        s.commit()
    return ids
