"""place_order() on Django's ORM: the order, its lines and its OrderPlaced outbox row in one transaction.

Validation (``parse_order``) and the event payload are the reference implementation's, so the
Django and Flask write sides publish the same OrderPlaced.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import IntegrityError, transaction

import celery_outbox.contrib.django
from celery_outbox import is_unique_violation
from celery_outbox.clock import Clock, SystemClock
from celery_outbox.errors import DatabaseError
from celery_outbox.writer import Event
from orders.service import ORDER_PLACED, DuplicateOrderError, OrderRequest, order_placed_payload
from shop.models import Order, OrderLine


def place_order(req: OrderRequest, *, clock: Clock | None = None, max_message_bytes: int | None = None,
                known_types: Iterable[str] | None = None, correlation_id: str | None = None) -> Order:
    """Write the order and its event atomically. Inside a caller's ``atomic()`` this is a savepoint
    and everything commits (or not) with the caller's block."""
    clock = clock or SystemClock()
    now = clock.now_ms()
    try:
        with transaction.atomic():
            order: Order = Order.objects.create(
                id=req.order_id, customer_id=req.customer_id, email=req.email, currency=req.currency,
                total_cents=req.total_cents, status="placed", created_at_ms=now,
            )
            OrderLine.objects.bulk_create([
                OrderLine(order=order, sku=li.sku, quantity=li.quantity, unit_price_cents=li.unit_price_cents)
                for li in req.lines
            ])
            celery_outbox.contrib.django.publish(
                Event(type=ORDER_PLACED, payload=order_placed_payload(req), correlation_id=correlation_id,
                      entity_key=f"order:{req.order_id}", entity_version=1),
                clock=clock, max_message_bytes=max_message_bytes, known_types=known_types,
            )
    except IntegrityError as e:
        if is_unique_violation(e):
            raise DuplicateOrderError(f"order {req.order_id!r} already exists") from e
        raise DatabaseError(f"placing order {req.order_id!r} failed: {e}") from e
    return order
