"""The reference deployment's declarative ``Base`` and the consumers' effect tables.

``Base`` is declared here, at the bottom of the deployment, so that the consumers' tables and the Orders
service's (orders/models.py, which stands above the consumers) share one metadata without an import
running back up. The inbox and dead letters are the library's tables (``celery_outbox.define_tables``).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    """The reference deployment's own tables (the library's live in ``celery_outbox.define_tables``)."""


JSONType = sa.JSON().with_variant(JSONB(), "postgresql")
# seq is the relay's order: a bigint identity on Postgres, SQLite's rowid alias there.
SeqType = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


class Shipment(Base):
    __tablename__ = "shipments"

    id: Mapped[int] = mapped_column(SeqType, sa.Identity(), primary_key=True)
    order_id: Mapped[str] = mapped_column(sa.String(64), index=True)
    address_line: Mapped[str] = mapped_column(sa.String(500), default="")
    items: Mapped[int] = mapped_column(sa.Integer)
    created_at_ms: Mapped[int] = mapped_column(sa.BigInteger)


class Invoice(Base):
    __tablename__ = "invoices"

    id: Mapped[int] = mapped_column(SeqType, sa.Identity(), primary_key=True)
    order_id: Mapped[str] = mapped_column(sa.String(64), index=True)
    amount_cents: Mapped[int] = mapped_column(sa.BigInteger)
    currency: Mapped[str] = mapped_column(sa.String(3))
    created_at_ms: Mapped[int] = mapped_column(sa.BigInteger)


class SearchDocument(Base):
    __tablename__ = "search_documents"

    order_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    body: Mapped[dict[str, Any]] = mapped_column(JSONType)
    version: Mapped[int] = mapped_column(sa.BigInteger, default=1)
    updated_at_ms: Mapped[int] = mapped_column(sa.BigInteger)


class SentEmail(Base):
    """The fake e-mail provider's record: one row per idempotency key it honoured."""

    __tablename__ = "sent_emails"

    idempotency_key: Mapped[str] = mapped_column(sa.String(100), primary_key=True)
    to: Mapped[str] = mapped_column(sa.String(320))
    subject: Mapped[str] = mapped_column(sa.String(500))
    calls: Mapped[int] = mapped_column(sa.Integer, default=1)
    sent_at_ms: Mapped[int] = mapped_column(sa.BigInteger)


