"""The shop's Django consumer: OrderPlaced -> one Shipment, however often the broker delivers it.

Retries, delivery counting and the dead-letter store are the library's (``celery_outbox.delivery``);
this module only says what one delivery does. Its task is ``consumers.fulfilment`` on the queue
``shop.fulfilment`` (``outbox.include`` in ``ShopConfig.ready``).
"""

from __future__ import annotations

from celery_outbox.clock import SystemClock
from celery_outbox.contrib.django import idempotent_consumer
from celery_outbox.errors import MalformedMessageError
from celery_outbox.messages import Envelope
from orders.service import ORDER_PLACED
from shop.models import Shipment


@idempotent_consumer(ORDER_PLACED, name="fulfilment")
def fulfilment(envelope: Envelope) -> None:
    """The effect. Runs inside the inbox's transaction: it commits with the inbox row or not at all."""
    payload = envelope.payload
    if not isinstance(payload, dict) or not isinstance(payload.get("order_id"), str):
        raise MalformedMessageError(f"{envelope.type} payload has no order_id")
    lines = payload.get("lines") or []
    Shipment.objects.create(
        order_id=payload["order_id"],
        items=sum(int(line.get("quantity", 0)) for line in lines if isinstance(line, dict)),
        address_line="",
        created_at_ms=SystemClock().now_ms(),
    )
