"""place_order(): the order, its OrderPlaced event and its confirmation e-mail task, in one commit or not at all."""

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
from orders.tasks import confirmation_email_task

ORDER_PLACED = "OrderPlaced"
# Every pattern is anchored with \A...\Z (``$`` also matches before a trailing newline) and ASCII-only.
ID_PATTERN = re.compile(r"\A[A-Za-z0-9_.:-]{1,64}\Z", re.ASCII)
_ID_RULE = "1-64 characters of letters, digits, '_.:-'"
# No whitespace, no control characters (NUL included), exactly one '@', a dot in the domain.
_EMAIL = re.compile(r"\A[^@\s\x00-\x1f\x7f-\x9f]+@[^@\s\x00-\x1f\x7f-\x9f]+\.[^@\s\x00-\x1f\x7f-\x9f]+\Z")
_CURRENCY = re.compile(r"\A[A-Z]{3}\Z", re.ASCII)
MAX_LINES = 200
# What the columns hold (orders.models): the request is refused before the database ever sees it.
EMAIL_MAX = 320
INT32_MAX = 2**31 - 1  # Integer: order_lines.quantity
INT64_MAX = 2**63 - 1  # BigInteger: unit_price_cents, total_cents
FIELDS = frozenset({"order_id", "customer_id", "email", "currency", "lines"})
LINE_FIELDS = frozenset({"sku", "quantity", "unit_price_cents"})


class DuplicateOrderError(ValidationError):
    """An order with this id already exists with other content; nothing was written."""


class OrderDataError(ValidationError):
    """The database refused the order's values (out of range, too long): the client's error, not an outage."""


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

    def same_order(self, order: Order) -> bool:
        """True when ``order`` (already stored) is exactly this request: a retry, not a conflict."""
        return (order.id, order.customer_id, order.email, order.currency, order.total_cents) == (
            self.order_id, self.customer_id, self.email, self.currency, self.total_cents) and [
            (li.sku, li.quantity, li.unit_price_cents) for li in order.lines] == [
            (li.sku, li.quantity, li.unit_price_cents) for li in self.lines]


def storable_text(value: str) -> bool:
    """Text every database here can store: no NUL, no lone surrogate (UTF-8 encodable)."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_id(value: Any, where: str) -> str:
    if not isinstance(value, str) or not ID_PATTERN.match(value):
        raise ValidationError(f"{where} must be {_ID_RULE}")
    return value


def _int_in_range(value: Any, where: str, *, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValidationError(f"{where} must be an integer from {low} to {high}")
    return value


def parse_order(data: Any, *, idempotency_key: str | None = None) -> OrderRequest:
    """Validate a JSON order body to what the columns hold; every problem is a ``ValidationError``
    that names the field (never echoing the client's value back).

    ``order_id`` is optional; when absent it is ``idempotency_key`` if given, else a new UUID. A present
    but empty, falsy or malformed ``order_id`` is an error, never a new id.
    """
    if not isinstance(data, Mapping):
        raise ValidationError("order must be a JSON object")
    unknown = set(data) - FIELDS
    if unknown:
        raise ValidationError(f"unknown field(s); an order has {', '.join(sorted(FIELDS))}")
    if idempotency_key is not None:
        check_id(idempotency_key, "the Idempotency-Key header")
    if "order_id" in data:
        order_id = check_id(data["order_id"], "order_id")
        if idempotency_key is not None and idempotency_key != order_id:
            raise ValidationError("the Idempotency-Key header and order_id name different orders; send one, "
                                  "or the same value in both")
    else:
        order_id = idempotency_key or str(uuid.uuid4())
    customer_id = check_id(data.get("customer_id"), "customer_id (required)")
    email = data.get("email")
    if not isinstance(email, str) or len(email) > EMAIL_MAX or not storable_text(email) or not _EMAIL.match(email):
        raise ValidationError(f"email must be an e-mail address of at most {EMAIL_MAX} characters")
    currency = data.get("currency", "EUR")
    if not isinstance(currency, str) or not _CURRENCY.match(currency):
        raise ValidationError("currency must be a 3-letter upper-case code like EUR")
    raw_lines = data.get("lines")
    if not isinstance(raw_lines, list) or not raw_lines:
        raise ValidationError("lines must be a non-empty list")
    if len(raw_lines) > MAX_LINES:
        raise ValidationError(f"an order has at most {MAX_LINES} lines, got {len(raw_lines)}")
    lines = []
    for i, line in enumerate(raw_lines):
        if not isinstance(line, Mapping):
            raise ValidationError(f"lines[{i}] must be an object")
        if set(line) - LINE_FIELDS:
            raise ValidationError(f"lines[{i}]: unknown field(s); a line has {', '.join(sorted(LINE_FIELDS))}")
        lines.append(LineRequest(
            sku=check_id(line.get("sku"), f"lines[{i}].sku"),
            quantity=_int_in_range(line.get("quantity"), f"lines[{i}].quantity", low=1, high=INT32_MAX),
            unit_price_cents=_int_in_range(line.get("unit_price_cents"), f"lines[{i}].unit_price_cents",
                                           low=0, high=INT64_MAX),
        ))
    req = OrderRequest(order_id=order_id, customer_id=customer_id, email=email, currency=currency,
                       lines=tuple(lines))
    if req.total_cents > INT64_MAX:
        raise ValidationError(f"the order's total is over {INT64_MAX} cents")
    return req


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
    """Write the order, its ``OrderPlaced`` event and its confirmation e-mail task in ONE commit.

    The task is enqueued with a plain ``.delay()`` inside ``outbox.transaction(session)`` (orders/tasks.py):
    it is an outbox row like the event. A failed commit (duplicate id, database down) rolls back all
    three and raises; there is never an order without its event and e-mail, nor either without the order.

    Errors carry no database text (it names hosts, ports and SQL): ``OrderDataError`` when the
    database refused the values, ``DatabaseError`` when it failed; the driver error is ``__cause__``.
    """
    now = outbox.clock.now_ms()
    order = Order(
        id=req.order_id, customer_id=req.customer_id, email=req.email, currency=req.currency,
        total_cents=req.total_cents, status="placed", created_at_ms=now,
        lines=[OrderLine(sku=li.sku, quantity=li.quantity, unit_price_cents=li.unit_price_cents)
               for li in req.lines],
    )
    try:
        with outbox.transaction(session):  # the task below becomes an outbox row of this transaction
            session.add(order)
            outbox.publish(session, Event(ORDER_PLACED, order_placed_payload(req), correlation_id=correlation_id,
                                          entity_key=f"order:{req.order_id}", entity_version=1))
            confirmation_email_task(outbox).delay(req.order_id)
        session.commit()
        (crash_points or outbox.crash_points).reached("after_order_commit")
    except exc.IntegrityError as e:
        session.rollback()
        if is_unique_violation(e):
            raise DuplicateOrderError(f"order {req.order_id!r} already exists") from e
        raise OrderDataError(f"order {req.order_id!r} does not fit the database's constraints") from e
    except exc.DataError as e:
        session.rollback()
        raise OrderDataError(f"order {req.order_id!r} has a value the database cannot store") from e
    except exc.DBAPIError as e:
        session.rollback()
        raise DatabaseError(f"placing order {req.order_id!r} failed: the database is unavailable") from e
    except BaseException:
        session.rollback()
        raise
    return order


def place_or_replay(session: Session, req: OrderRequest, *, outbox: Outbox,
                    correlation_id: str | None = None) -> tuple[Order, bool]:
    """``place_order`` for a request that may be a retry: ``(order, True)`` when written now,
    ``(stored order, False)`` when an order with this id and exactly this content already exists
    (nothing is written again, no second event). Same id with other content: ``DuplicateOrderError``."""
    try:
        return place_order(session, req, outbox=outbox, correlation_id=correlation_id), True
    except DuplicateOrderError:
        try:
            existing = session.get(Order, req.order_id)
        except exc.DBAPIError as e:
            session.rollback()
            raise DatabaseError(f"reading order {req.order_id!r} failed: the database is unavailable") from e
        if existing is not None and req.same_order(existing):
            return existing, False
        raise
