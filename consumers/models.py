"""The consumer side's tables: the inbox, the consumer dead-letter store, parked messages, effects."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from orders.models import JSONType, SeqType
from outbox.db import Base


class InboxEntry(Base):
    """(message_id, consumer) seen and committed with its effect. The primary key IS the guarantee."""

    __tablename__ = "inbox"

    message_id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, primary_key=True)
    consumer: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    type: Mapped[str] = mapped_column(sa.String(200))
    processed_at_ms: Mapped[int] = mapped_column(sa.BigInteger, index=True)


class DeliveryAttempt(Base):
    """Failed deliveries per (message, consumer), counted in the database so redeliveries after a
    killed worker count too (Celery's ``request.retries`` only counts ``self.retry``)."""

    __tablename__ = "consumer_attempts"

    message_id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, primary_key=True)
    consumer: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    deliveries: Mapped[int] = mapped_column(sa.Integer, default=0)
    first_failed_at_ms: Mapped[int] = mapped_column(sa.BigInteger)
    last_failed_at_ms: Mapped[int] = mapped_column(sa.BigInteger)
    last_error: Mapped[str] = mapped_column(sa.Text)


class ConsumerDeadLetter(Base):
    """A message a consumer gave up on. Kept raw (``body``) so even malformed input is never lost."""

    __tablename__ = "consumer_dead_letters"

    id: Mapped[int] = mapped_column(SeqType, sa.Identity(), primary_key=True)
    consumer: Mapped[str] = mapped_column(sa.String(64), index=True)
    message_id: Mapped[str] = mapped_column(sa.String(64))
    type: Mapped[str | None] = mapped_column(sa.String(200), nullable=True)
    body: Mapped[str] = mapped_column(sa.Text)
    headers: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    delivery_count: Mapped[int] = mapped_column(sa.Integer)
    last_error: Mapped[str] = mapped_column(sa.Text)
    first_failed_at_ms: Mapped[int] = mapped_column(sa.BigInteger)
    last_failed_at_ms: Mapped[int] = mapped_column(sa.BigInteger)
    replayed_at_ms: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)


class ParkedMessage(Base):
    """An event that arrived ahead of its entity's next version, waiting for the gap to fill."""

    __tablename__ = "parked_messages"

    message_id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, primary_key=True)
    consumer: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    entity_key: Mapped[str] = mapped_column(sa.String(200))
    entity_version: Mapped[int] = mapped_column(sa.BigInteger)
    envelope: Mapped[dict[str, Any]] = mapped_column(JSONType)
    parked_at_ms: Mapped[int] = mapped_column(sa.BigInteger)

    __table_args__ = (sa.Index("ix_parked_entity", "consumer", "entity_key", "entity_version"),)


class EntityVersion(Base):
    """The last version of an entity a consumer applied (per-entity ordering, opt-in)."""

    __tablename__ = "consumer_entity_versions"

    consumer: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    entity_key: Mapped[str] = mapped_column(sa.String(200), primary_key=True)
    version: Mapped[int] = mapped_column(sa.BigInteger)


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


class ConsumerCounter(Base):
    """Monotonic counters the inbox keeps outside the rolled-back transaction (duplicates absorbed)."""

    __tablename__ = "consumer_counters"

    consumer: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    value: Mapped[int] = mapped_column(sa.BigInteger, default=0)
