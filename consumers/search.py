"""Search: upsert the order's search document. Opts into per-entity ordering, so an older version of
an order can never overwrite a newer document."""

from __future__ import annotations

from sqlalchemy.orm import Session

from celery_outbox import Envelope, consumer, effect_now_ms, upsert
from consumers.models import SearchDocument
from consumers.payloads import order_placed


@consumer(name="search", event="OrderPlaced", ordering=True)
def search(session: Session, envelope: Envelope) -> None:
    order = order_placed(envelope)
    version = envelope.headers.get("entity_version")
    body = {
        "order_id": order.order_id,
        "customer_id": order.customer_id,
        "email": order.email,
        "currency": order.currency,
        "total_cents": order.total_cents,
        "skus": sorted({str(line.get("sku", "")) for line in order.lines}),
    }
    now = effect_now_ms(session)
    values = {"order_id": order.order_id, "body": body, "version": version if isinstance(version, int) else 1,
              "updated_at_ms": now}
    session.execute(upsert(session, SearchDocument, values, keys=("order_id",),
                           update={"body": values["body"], "version": values["version"], "updated_at_ms": now}))
