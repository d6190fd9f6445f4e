"""Helpers for tests (ours and users'): realistic envelopes without a relay or a broker."""

from __future__ import annotations

import uuid
from typing import Any

from celery_outbox import Envelope


def order_placed_envelope(order_id: str = "o-1", *, message_id: uuid.UUID | None = None, version: int | None = 1,
                          email: str = "ada@example.com", quantity: int = 2, unit_price_cents: int = 1250,
                          created_at_ms: int = 1_700_000_000_000, **payload: Any) -> Envelope:
    """An ``OrderPlaced`` envelope like ``place_order`` writes (entity ``order:<id>``, version 1)."""
    body: dict[str, Any] = {
        "order_id": order_id, "customer_id": "c-1", "email": email, "currency": "EUR",
        "total_cents": quantity * unit_price_cents,
        "lines": [{"sku": "sku-1", "quantity": quantity, "unit_price_cents": unit_price_cents}],
    }
    body.update(payload)
    mid = message_id or uuid.uuid4()
    headers: dict[str, Any] = {"correlation_id": str(mid)}
    if version is not None:
        headers.update(entity_key=f"order:{order_id}", entity_version=version)
    return Envelope(message_id=mid, type="OrderPlaced", payload=body, headers=headers, created_at_ms=created_at_ms)
