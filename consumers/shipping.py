"""Shipping: one Shipment per OrderPlaced."""

from __future__ import annotations

from sqlalchemy.orm import Session

from celery_outbox import Envelope, consumer, effect_now_ms
from consumers.models import Shipment
from consumers.payloads import order_placed


@consumer(name="shipping", event="OrderPlaced")
def shipping(session: Session, envelope: Envelope) -> None:
    order = order_placed(envelope)
    address = envelope.payload.get("address", "") if isinstance(envelope.payload, dict) else ""
    session.add(Shipment(order_id=order.order_id, address_line=str(address)[:500], items=order.items,
                         created_at_ms=effect_now_ms(session)))
