"""The Orders service's tables: orders and their lines (the outbox row is written in the same commit).

They declare on the deployment's one ``Base`` (consumers/models.py), so the deployment's migrations
(orders/migrations) see every table of it in one metadata.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column, relationship

from consumers.models import Base, SeqType


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
