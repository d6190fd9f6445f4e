"""The write side's tables: orders, their lines, and the outbox row written in the same commit."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column, relationship

from outbox.db import Base

JSONType = sa.JSON().with_variant(JSONB(), "postgresql")
# seq is the relay's order: a bigint identity on Postgres, SQLite's rowid alias there.
SeqType = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

PENDING = sa.text("published_at_ms IS NULL AND dead_lettered_at_ms IS NULL")


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    customer_id: Mapped[str] = mapped_column(sa.String(64))
    email: Mapped[str] = mapped_column(sa.String(320))
    currency: Mapped[str] = mapped_column(sa.String(3))
    total_cents: Mapped[int] = mapped_column(sa.BigInteger)
    status: Mapped[str] = mapped_column(sa.String(32), default="placed")
    created_at_ms: Mapped[int] = mapped_column(sa.BigInteger)

    lines: Mapped[list[OrderLine]] = relationship(
        back_populates="order", cascade="all, delete-orphan", order_by="OrderLine.id"
    )


class OrderLine(Base):
    __tablename__ = "order_lines"

    id: Mapped[int] = mapped_column(SeqType, sa.Identity(), primary_key=True)
    order_id: Mapped[str] = mapped_column(sa.ForeignKey("orders.id", ondelete="CASCADE"), index=True)
    sku: Mapped[str] = mapped_column(sa.String(64))
    quantity: Mapped[int] = mapped_column(sa.Integer)
    unit_price_cents: Mapped[int] = mapped_column(sa.BigInteger)

    order: Mapped[Order] = relationship(back_populates="lines")


class OutboxMessage(Base):
    """One event waiting for (or past) the relay. ``published_at_ms IS NULL`` means pending."""

    __tablename__ = "outbox"

    seq: Mapped[int] = mapped_column(SeqType, sa.Identity(), primary_key=True)
    message_id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, unique=True, default=uuid.uuid4)
    type: Mapped[str] = mapped_column(sa.String(200))
    payload: Mapped[Any] = mapped_column(JSONType)
    headers: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    created_at_ms: Mapped[int] = mapped_column(sa.BigInteger)
    published_at_ms: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)
    attempts: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    next_attempt_at_ms: Mapped[int] = mapped_column(sa.BigInteger)
    dead_lettered_at_ms: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)
    last_error: Mapped[str | None] = mapped_column(sa.Text, nullable=True)

    __table_args__ = (
        # Keeps the relay's query O(batch) however much published history the table holds.
        sa.Index("ix_outbox_pending", "seq", postgresql_where=PENDING, sqlite_where=PENDING),
        # Retention prunes published rows oldest first without scanning pending ones.
        sa.Index(
            "ix_outbox_published",
            "published_at_ms",
            postgresql_where=sa.text("published_at_ms IS NOT NULL"),
            sqlite_where=sa.text("published_at_ms IS NOT NULL"),
        ),
    )
