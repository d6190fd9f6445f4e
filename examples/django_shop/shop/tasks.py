"""The shop's Django consumer: OrderPlaced -> one Shipment, however often the broker delivers it.

Registered under ``consumers.fulfilment`` (``outbox.messages.task_name``), the name the relay
addresses, on the queue ``<namespace>.fulfilment`` that ``celery_config`` declares.
"""

from __future__ import annotations

import logging
from typing import Any

from shop_project.celery import app

from consumers.outcome import Outcome
from outbox.clock import SystemClock
from outbox.errors import MalformedMessageError
from outbox.messages import Envelope, task_name
from outbox_django import idempotent_consumer
from outbox_django.consumer import dead_letter
from shop.models import Shipment

log = logging.getLogger(__name__)

FULFILMENT = "fulfilment"
MAX_RETRIES = 3


@idempotent_consumer(FULFILMENT)
def create_shipment(envelope: Envelope) -> None:
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


# shared=False: only this project's app gets the task (not every Celery app in the process).
@app.task(name=task_name(FULFILMENT), bind=True, acks_late=True, max_retries=MAX_RETRIES, shared=False)  # type: ignore[untyped-decorator]
def fulfilment(self: Any, envelope: Any) -> str:
    """Returning acks; raising (via ``retry``) redelivers; poison and the last failure are dead-lettered."""
    try:
        return create_shipment(envelope).value
    except MalformedMessageError as e:
        dead_letter(FULFILMENT, envelope, e, delivery_count=self.request.retries + 1)
        log.error("%s: malformed message dead-lettered: %s", FULFILMENT, e)
        return Outcome.DEAD_LETTERED.value
    except Exception as e:
        if self.request.retries >= MAX_RETRIES:
            dead_letter(FULFILMENT, envelope, e, delivery_count=self.request.retries + 1)
            log.exception("%s: gave up after %d deliveries", FULFILMENT, self.request.retries + 1)
            return Outcome.DEAD_LETTERED.value
        raise self.retry(exc=e, countdown=min(2 ** self.request.retries, 60)) from e
