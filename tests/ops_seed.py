"""Rows for the ops tests: outbox rows in each state, consumer dead letters, inbox entries."""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy.orm import Session

from celery_outbox.inbox import dead_letters as consumer_dead_letters
from celery_outbox.schema import OutboxRow, Tables

T0 = 1_700_000_000_000


def order_payload(order_id: str) -> dict[str, Any]:
    return {"order_id": order_id, "customer_id": "c-1", "email": f"{order_id}@example.com", "currency": "EUR",
            "total_cents": 1000, "lines": [{"sku": "s", "quantity": 2, "unit_price_cents": 500}]}


def outbox_row(session: Session, *, tables: Tables, created_at_ms: int = T0, published_at_ms: int | None = None,
               dead_lettered_at_ms: int | None = None, attempts: int = 0, last_error: str | None = None,
               type: str = "OrderPlaced", payload: Any = None) -> OutboxRow:
    row = tables.outbox(message_id=uuid.uuid4(), type=type, payload=payload or order_payload(uuid.uuid4().hex[:8]),
                        headers={"correlation_id": "corr-1"}, created_at_ms=created_at_ms,
                        published_at_ms=published_at_ms, attempts=attempts, next_attempt_at_ms=created_at_ms,
                        dead_lettered_at_ms=dead_lettered_at_ms, last_error=last_error)
    session.add(row)
    session.commit()
    return row


def envelope(order_id: str = "o-1", *, message_id: uuid.UUID | None = None) -> dict[str, Any]:
    return {"message_id": str(message_id or uuid.uuid4()), "type": "OrderPlaced",
            "payload": order_payload(order_id), "headers": {}, "created_at_ms": T0}


def consumer_dead_letter(session: Session, *, tables: Tables, consumer: str = "shipping",
                         env: dict[str, Any] | None = None, body: str | None = None, failed_at_ms: int = T0,
                         error: str = "boom") -> int:
    env = env or envelope()
    row = consumer_dead_letters.record(
        session, tables=tables, consumer=consumer, message_id=str(env.get("message_id", "?")), type=env.get("type"),
        body=body if body is not None else json.dumps(env), headers={}, delivery_count=3, last_error=error,
        first_failed_at_ms=failed_at_ms - 1000, last_failed_at_ms=failed_at_ms)
    session.commit()
    return row.id


def inbox_rows(session: Session, *, tables: Tables, consumer: str, processed_at_ms: int, n: int) -> None:
    session.add_all(tables.inbox(message_id=uuid.uuid4(), consumer=consumer, type="OrderPlaced",
                                 processed_at_ms=processed_at_ms) for _ in range(n))
    session.commit()


def counter(session: Session, *, tables: Tables, consumer: str, name: str, value: int) -> None:
    session.add(tables.counters(consumer=consumer, name=name, value=value))
    session.commit()
