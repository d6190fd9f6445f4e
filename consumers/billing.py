"""Billing: one Invoice per OrderPlaced."""

from __future__ import annotations

from sqlalchemy.orm import Session

from celery_outbox import Envelope, consumer, effect_now_ms
from consumers.models import Invoice
from consumers.payloads import order_placed


@consumer(name="billing", event="OrderPlaced")
def billing(session: Session, envelope: Envelope) -> None:
    order = order_placed(envelope)
    session.add(Invoice(order_id=order.order_id, amount_cents=order.total_cents, currency=order.currency,
                        created_at_ms=effect_now_ms(session)))
