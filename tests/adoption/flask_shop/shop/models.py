"""The team's own models (not glue: they exist before the outbox)."""
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass

class Order(Base):
    __tablename__ = "orders"
    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)

class Notification(Base):
    __tablename__ = "notifications"
    order_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)

class Confirmation(Base):
    __tablename__ = "confirmations"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    order_id: Mapped[str] = mapped_column(sa.String(64))
