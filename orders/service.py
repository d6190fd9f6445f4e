"""place_order(): the order and its OrderPlaced outbox row, in one commit or not at all."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import exc
from sqlalchemy.orm import Session

from celery_outbox import CrashPoints, DatabaseError, Event, Outbox, ValidationError, is_unique_violation
from orders.models import Order, OrderLine

ORDER_PLACED = "OrderPlaced"
_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
_CURRENCY = re.compile(r"^[A-Z]{3}$")
MAX_LINES = 200


class DuplicateOrderError(ValidationError):
    """An order with this id already exists; nothing was written."""


@dataclass(frozen=True, kw_only=True)
class LineRequest:
    sku: str
    quantity: int
    unit_price_cents: int


@dataclass(frozen=True, kw_only=True)
class OrderRequest:
    order_id: str
    customer_id: str
    email: str
    currency: str
    lines: tuple[LineRequest, ...]

    @property
    def total_cents(self) -> int:
        return sum(line.quantity * line.unit_price_cents for line in self.lines)


def _positive_int(value: Any, where: str, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise ValidationError(f"{where} must be {'a non-negative' if allow_zero else 'a positive'} "
                              f"integer, got {value!r}")
    return value


def parse_order(data: Any) -> OrderRequest:
    """Validate a JSON order body; every problem is a ``ValidationError`` that names the field."""
    if not isinstance(data, Mapping):
        raise ValidationError("order must be a JSON object")
    unknown = set(data) - {"order_id", "customer_id", "email", "currency", "lines"}
    if unknown:
        raise ValidationError(f"unknown field(s): {', '.join(sorted(unknown))}")
    order_id = data.get("order_id") or str(uuid.uuid4())
    if not isinstance(order_id, str) or not _ID.match(order_id):
        raise ValidationError("order_id must be 1-64 characters of letters, digits, '_.:-'")
    customer_id = data.get("customer_id")
    if not isinstance(customer_id, str) or not _ID.match(customer_id):
        raise ValidationError("customer_id is required: 1-64 characters of letters, digits, '_.:-'")
    email = data.get("email")
    if not isinstance(email, str) or len(email) > 320 or not _EMAIL.match(email):
        raise ValidationError(f"email must be an e-mail address, got {email!r}")
    currency = data.get("currency", "EUR")
    if not isinstance(currency, str) or not _CURRENCY.match(currency):
        raise ValidationError(f"currency must be a 3-letter upper-case code, got {currency!r}")
    raw_lines = data.get("lines")
    if not isinstance(raw_lines, list) or not raw_lines:
        raise ValidationError("lines must be a non-empty list")
    if len(raw_lines) > MAX_LINES:
        raise ValidationError(f"an order has at most {MAX_LINES} lines, got {len(raw_lines)}")
    lines = []
    for i, line in enumerate(raw_lines):
        if not isinstance(line, Mapping):
            raise ValidationError(f"lines[{i}] must be an object")
        sku = line.get("sku")
        if not isinstance(sku, str) or not _ID.match(sku):
            raise ValidationError(f"lines[{i}].sku must be 1-64 characters of letters, digits, '_.:-'")
        lines.append(LineRequest(
            sku=sku,
            quantity=_positive_int(line.get("quantity"), f"lines[{i}].quantity"),
            unit_price_cents=_positive_int(line.get("unit_price_cents"), f"lines[{i}].unit_price_cents",
                                           allow_zero=True),
        ))
    return OrderRequest(order_id=order_id, customer_id=customer_id, email=email, currency=currency,
                        lines=tuple(lines))


def order_placed_payload(req: OrderRequest) -> dict[str, Any]:
    return {
        "order_id": req.order_id,
        "customer_id": req.customer_id,
        "email": req.email,
        "currency": req.currency,
        "total_cents": req.total_cents,
        "lines": [
            {"sku": li.sku, "quantity": li.quantity, "unit_price_cents": li.unit_price_cents}
            for li in req.lines
        ],
    }


def place_order(session: Session, req: OrderRequest, *, outbox: Outbox, correlation_id: str | None = None,
                crash_points: CrashPoints | None = None) -> Order:
    """Write the order and its ``OrderPlaced`` event in ONE commit.

    A failed commit (duplicate id, database down) rolls back both and raises; there is never an
    order without its event nor an event without its order.
    """
    now = outbox.clock.now_ms()
    order = Order(
        id=req.order_id, customer_id=req.customer_id, email=req.email, currency=req.currency,
        total_cents=req.total_cents, status="placed", created_at_ms=now,
        lines=[OrderLine(sku=li.sku, quantity=li.quantity, unit_price_cents=li.unit_price_cents)
               for li in req.lines],
    )
    try:
        session.add(order)
        outbox.publish(session, Event(ORDER_PLACED, order_placed_payload(req), correlation_id=correlation_id,
                                      entity_key=f"order:{req.order_id}", entity_version=1))
        session.commit()
        (crash_points or outbox.crash_points).reached("after_order_commit")
    except exc.IntegrityError as e:
        session.rollback()
        if is_unique_violation(e):
            raise DuplicateOrderError(f"order {req.order_id!r} already exists") from e
        raise DatabaseError(f"placing order {req.order_id!r} failed: {e.orig}") from e
    except exc.DBAPIError as e:
        session.rollback()
        raise DatabaseError(f"placing order {req.order_id!r} failed: {e.orig}") from e
    except BaseException:
        session.rollback()
        raise
    return order
