"""Reading event payloads: a missing or mistyped field is a ``MalformedMessageError`` that names it,
so a bad payload is dead-lettered with a clear error instead of a KeyError."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery_outbox import Envelope, MalformedMessageError


def _field(payload: Mapping[str, Any], name: str, typ: type, where: str) -> Any:
    if name not in payload:
        raise MalformedMessageError(f"{where} payload is missing required field {name!r}")
    value = payload[name]
    if isinstance(value, bool) or not isinstance(value, typ):
        raise MalformedMessageError(f"{where} payload field {name!r} must be {typ.__name__}, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class OrderPlaced:
    order_id: str
    customer_id: str
    email: str
    currency: str
    total_cents: int
    lines: tuple[Mapping[str, Any], ...]

    @property
    def items(self) -> int:
        return sum(int(line.get("quantity", 0)) for line in self.lines)


def order_placed(envelope: Envelope) -> OrderPlaced:
    payload = envelope.payload
    where = f"{envelope.type} {envelope.message_id}"
    if not isinstance(payload, Mapping):
        raise MalformedMessageError(f"{where} payload must be a JSON object, got {type(payload).__name__}")
    lines = _field(payload, "lines", list, where)
    if not all(isinstance(line, Mapping) for line in lines):
        raise MalformedMessageError(f"{where} payload field 'lines' must be a list of objects")
    return OrderPlaced(
        order_id=_field(payload, "order_id", str, where),
        customer_id=_field(payload, "customer_id", str, where),
        email=_field(payload, "email", str, where),
        currency=_field(payload, "currency", str, where),
        total_cents=_field(payload, "total_cents", int, where),
        lines=tuple(lines),
    )
