"""The outbox writer: add an event to the caller's session so it commits with the caller's data.

Any SQLAlchemy app (Flask, FastAPI, Django with SQLAlchemy) calls ``add(session, event)`` inside the
unit of work that changes its entities; nothing here commits or talks to a broker.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from celery_outbox import tracing
from celery_outbox.clock import Clock, SystemClock
from celery_outbox.errors import UnknownEventTypeError, ValidationError
from celery_outbox.messages import check_size, encode_json
from celery_outbox.schema import OutboxRow, Tables


@dataclass(frozen=True)
class Event:
    """A fact to publish. ``entity_key``/``entity_version`` opt the event into per-entity ordering."""

    type: str
    payload: Mapping[str, Any]
    _: KW_ONLY
    message_id: uuid.UUID = field(default_factory=uuid.uuid4)
    correlation_id: str | None = None
    causation_id: str | None = None
    entity_key: str | None = None
    entity_version: int | None = None

    def headers(self) -> dict[str, Any]:
        h: dict[str, Any] = {"correlation_id": self.correlation_id or str(self.message_id)}
        if self.causation_id:
            h["causation_id"] = self.causation_id
        if self.entity_key is not None:
            h["entity_key"] = self.entity_key
            h["entity_version"] = self.entity_version
        return h


def outbox_values(event: Event, *, clock: Clock | None = None, max_message_bytes: int | None = None,
                  known_types: Iterable[str] | None = None) -> dict[str, Any]:
    """Validate ``event`` and return the column values of its pending outbox row.

    The one place that decides what an outbox row holds, shared by every writer (this SQLAlchemy
    one and ``outbox_django``). Refuses, before anything is written, an event that could never be
    delivered: no type, a payload that is not JSON, one over the size limit, or (when
    ``known_types`` is given) a type that no consumer is routed for.
    """
    if not isinstance(event.type, str) or not event.type.strip():
        raise ValidationError("event type must be a non-empty string")
    if known_types is not None and event.type not in set(known_types):
        raise UnknownEventTypeError(
            f"no consumer is routed for event type {event.type!r}; add it to OUTBOX_ROUTES"
        )
    if event.entity_key is not None and (
        not isinstance(event.entity_version, int) or event.entity_version < 1
    ):
        raise ValidationError("entity_version must be a positive integer when entity_key is set")
    headers = event.headers()
    encoded = encode_json({"payload": event.payload, "headers": headers}, what=f"{event.type} event")
    if max_message_bytes is not None:
        check_size(encoded, limit=max_message_bytes, what=f"{event.type} event")
    headers = _with_trace_context(event, headers, max_message_bytes)
    now = (clock or SystemClock()).now_ms()
    return {
        "message_id": event.message_id,
        "type": event.type,
        "payload": dict(event.payload),
        "headers": headers,
        "created_at_ms": now,
        "next_attempt_at_ms": now,
        "attempts": 0,
    }


def _with_trace_context(event: Event, headers: dict[str, Any], max_message_bytes: int | None) -> dict[str, Any]:
    """``headers`` plus the current trace context (``celery_outbox.tracing``), so the relay and the
    consumers continue the writer's trace. Added after the event was judged on its own: the context
    never makes an event refused, it is left out when it would not fit the size limit."""
    traced = tracing.traced_headers(headers)
    if traced is headers or max_message_bytes is None:
        return traced
    size = len(encode_json({"payload": event.payload, "headers": traced}).encode())
    return traced if size <= max_message_bytes else headers


def add(session: Session, event: Event, *, tables: Tables, clock: Clock | None = None,
        max_message_bytes: int | None = None, known_types: Iterable[str] | None = None) -> OutboxRow:
    """Stage ``event`` as a pending outbox row in ``session`` (the caller commits).

    Validation is ``outbox_values``: nothing is added to the session for an event it refuses.
    """
    row = tables.outbox(**outbox_values(event, clock=clock, max_message_bytes=max_message_bytes,
                                        known_types=known_types))
    session.add(row)
    return row
