"""Search: upsert the orders' search documents, a batch at a time.

A batch consumer (docs/tasks.md, "Batch consumers"): the handler gets every first delivery of a batch and
writes all their documents in ONE statement, guarded by the event's version (``ON CONFLICT (order_id) DO
UPDATE ... WHERE search_documents.version < excluded.version``), so an older version of an order never
overwrites a newer document whatever order the messages arrive in, and a batch needs no per-entity
ordering. What it gives up against an ordered consumer: an intermediate version that arrives after a
newer one is skipped, never applied (the document only ever moves forward, to the newest version seen).

``search_in_order`` is the same effect as a per-entity ordered consumer (``ordering=True``: every version
applied once, in version order; an early one parked). The deployment does not register it; the ordering
run under several relays (chaos/ordering_run.py) does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from celery_outbox import Envelope, consumer, effect_now_ms
from consumers.models import SearchDocument
from consumers.payloads import order_placed

BATCH_SIZE = 50
BATCH_WAIT_MS = 20


def document(envelope: Envelope, now_ms: int) -> dict[str, Any]:
    """The search document row of one ``OrderPlaced`` (its version from the event's ``entity_version``)."""
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
    return {"order_id": order.order_id, "body": body,
            "version": version if isinstance(version, int) and not isinstance(version, bool) else 1,
            "updated_at_ms": now_ms}


def upsert_documents(session: Session, envelopes: Sequence[Envelope]) -> None:
    """One statement for every document of ``envelopes``; a stored document is replaced only by a newer
    version. Within the batch the newest version of each order wins (Postgres refuses one statement that
    updates a row twice, so each order appears once). Rows go in order-id order, so two batches that
    share orders lock their documents in the same order and cannot deadlock each other."""
    now = effect_now_ms(session)
    newest: dict[str, dict[str, Any]] = {}
    for envelope in envelopes:
        row = document(envelope, now)
        held = newest.get(row["order_id"])
        if held is None or row["version"] >= held["version"]:
            newest[row["order_id"]] = row
    if not newest:
        return
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(SearchDocument).values([newest[k] for k in sorted(newest)])
    session.execute(stmt.on_conflict_do_update(
        index_elements=["order_id"],
        set_={"body": stmt.excluded.body, "version": stmt.excluded.version, "updated_at_ms": stmt.excluded.updated_at_ms},
        where=SearchDocument.version < stmt.excluded.version))


@consumer(name="search", event="OrderPlaced", batch_size=BATCH_SIZE, batch_wait_ms=BATCH_WAIT_MS)
def search(session: Session, envelopes: list[Envelope]) -> None:
    upsert_documents(session, envelopes)


@consumer(name="search", event="OrderPlaced", ordering=True)
def search_in_order(session: Session, envelope: Envelope) -> None:
    upsert_documents(session, [envelope])
