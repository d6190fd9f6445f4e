"""What the consumers did, counted from their own tables (the demo's summary and ``outbox stats``)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox import Tables, wrap_driver_errors
from consumers.models import Invoice, SearchDocument, SentEmail, Shipment


def effect_counts(session: Session) -> dict[str, int]:
    """shipping -> shipments, billing -> invoices, search -> search documents, email -> e-mails sent
    (distinct idempotency keys, however often the provider was called)."""
    with wrap_driver_errors("counting consumer effects"):
        def count(column: Any) -> int:
            return int(session.execute(sa.select(sa.func.count(column))).scalar_one())

        return {
            "shipping": count(Shipment.id),
            "billing": count(Invoice.id),
            "search": count(SearchDocument.order_id),
            "email": int(session.execute(sa.select(sa.func.count(sa.distinct(SentEmail.idempotency_key))))
                         .scalar_one()),
        }


def duplicates_absorbed(session: Session, tables: Tables) -> dict[str, int]:
    """Per consumer, how many deliveries the inbox turned into DUPLICATE (consumers with none absent).

    A counter may be kept in several rows, ``duplicates`` and ``duplicates#<n>`` (docs/operations.md)."""
    c = tables.counters
    with wrap_driver_errors("reading duplicate counters"):
        rows = session.execute(
            sa.select(c.consumer, sa.func.sum(c.value))
            .where(sa.or_(c.name == "duplicates", c.name.like("duplicates#%")))
            .group_by(c.consumer).order_by(c.consumer)
        ).all()
    return {consumer: int(value) for consumer, value in rows}


def email_provider_calls(session: Session) -> int:
    """Total calls the fake provider received (>= e-mails sent; the difference is what keys absorbed)."""
    with wrap_driver_errors("reading e-mail provider calls"):
        return int(session.execute(sa.select(sa.func.coalesce(sa.func.sum(SentEmail.calls), 0))).scalar_one())
