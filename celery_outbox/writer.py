"""The outbox writer: add an event to the caller's session so it commits with the caller's data.

Any SQLAlchemy app (Flask, FastAPI, Django with SQLAlchemy) calls ``add(session, event)`` inside the
unit of work that changes its entities; nothing here commits or talks to a broker.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from celery_outbox import tracing
from celery_outbox.clock import Clock, SystemClock
from celery_outbox.entity_headers import entity_problem
from celery_outbox.errors import MalformedMessageError, MessageTooLargeError, UnknownEventTypeError, ValidationError
from celery_outbox.messages import (
    DEFAULT_MAX_JSON_DEPTH,
    TYPE_MAX_CHARS,
    Envelope,
    celery_task_messages,
    encode_json,
    is_storable,
)
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
                  known_types: Iterable[str] | None = None,
                  max_json_depth: int = DEFAULT_MAX_JSON_DEPTH) -> dict[str, Any]:
    """Validate ``event`` and return the column values of its pending outbox row.

    The one place that decides what an outbox row holds, shared by every writer (this SQLAlchemy one
    and the Django one, ``contrib/django/writer.py``). Refuses, before anything is written, an event that
    could never be delivered: no type, a payload that is not JSON, text the database cannot store (NUL, lone
    surrogates), object keys that are not strings, a message over the size limit or nested deeper than
    the consumers accept (measured exactly as the relay and the consumers measure it), or (when
    ``known_types`` is given) a type that no consumer is routed for.
    """
    require_event(event)
    if not isinstance(event.type, str) or not event.type.strip():
        raise ValidationError("event type must be a non-empty string")
    if len(event.type) > TYPE_MAX_CHARS or not event.type.isprintable() or not is_storable(event.type):
        # judged first: every later message names the type, and one holding NUL or a lone surrogate cannot be shown
        raise ValidationError(f"event type must be at most {TYPE_MAX_CHARS} printable characters, got "
                              f"{event.type[:60]!r}{'...' if len(event.type) > 60 else ''}")
    if not isinstance(event.payload, Mapping):
        # dict() of a list of pairs would be written as another object, and of [] as {}: refused, not reshaped
        raise ValidationError(f"{event.type} event payload must be a JSON object (a mapping), got "
                              f"{type(event.payload).__name__}")
    message_id = _message_id(event.message_id)
    if known_types is not None and event.type not in set(known_types):
        raise UnknownEventTypeError(
            f"no consumer is routed for event type {event.type!r}; add it to OUTBOX_ROUTES"
        )
    _check_entity(event)
    _check_ids(event)
    headers = event.headers()
    _check_storable(event.payload, what=f"{event.type} event payload")
    _check_storable(headers, what=f"{event.type} event headers")
    encode_json({"payload": event.payload, "headers": headers}, what=f"{event.type} event")
    now = (clock or SystemClock()).now_ms()
    envelope = Envelope(message_id=message_id, type=event.type, payload=event.payload, headers=headers,
                        created_at_ms=now)
    try:  # the consumers' own check, so an accepted event is one every consumer can read
        Envelope.from_dict(envelope.to_dict(), max_depth=max_json_depth)
    except MalformedMessageError as e:
        raise ValidationError(f"{event.type} event cannot be delivered: {e}") from None
    if max_message_bytes is not None:  # the relay's own measure: the whole task message body
        celery_task_messages(envelope, targets=[], max_bytes=max_message_bytes)
    headers = _with_trace_context(event, headers, max_message_bytes, now)
    return {
        "message_id": message_id,
        "type": event.type,
        "payload": dict(event.payload),
        "headers": headers,
        "created_at_ms": now,
        "next_attempt_at_ms": now,
        "attempts": 0,
    }


def require_event(event: object, *, verb: str = "publish") -> Event:
    """``event`` itself when it is an ``Event``; anything else (a dict, None) is a ``TypeError`` naming the verb,
    as a session of the wrong type is (``db.resolve_session``), not an ``AttributeError`` from inside."""
    if not isinstance(event, Event):
        raise TypeError(f"outbox.{verb}() needs an Event(type, payload), got {type(event).__name__}")
    return event


def _message_id(value: Any) -> uuid.UUID:
    """The event's id as the ``message_id`` column takes it: a ``uuid.UUID``, or its canonical text (what
    ``str(uuid)`` writes). Anything else is refused here: the column's driver would fail it at the caller's
    commit, taking the caller's own writes with it, and another spelling of a UUID is not the id it names."""
    if isinstance(value, uuid.UUID):
        return value
    if isinstance(value, str) and len(value) == 36:
        with contextlib.suppress(ValueError):
            parsed = uuid.UUID(value)
            if str(parsed) == value.lower():
                return parsed
    raise ValidationError(f"message_id must be a uuid.UUID (or its canonical text), got {type(value).__name__} "
                          f"{str(value)[:40]!r}")


def _check_entity(event: Event) -> None:
    """Per-entity ordering headers every ordered consumer can apply (``entity_headers.entity_problem``). Refused rather
    than written: a key the consumer cannot store, or a version past its column, dead-letters the event at every
    ordered consumer; an empty or non-text key, a bool version or a version without a key would turn ordering
    off for the event without a word."""
    if (problem := entity_problem(event.entity_key, event.entity_version)) is not None:
        raise ValidationError(problem)


# ``outbox trace`` finds a message by its correlation id: printable text of at most this many characters
ID_MAX_CHARS = 200


def _check_ids(event: Event) -> None:
    """``correlation_id`` and ``causation_id``: text a person can trace by (``outbox trace``, the admin pages), or
    None. Another type was written as it was (an int, a list, an object), and a longer or unprintable id could
    never be traced."""
    for name in ("correlation_id", "causation_id"):
        value = getattr(event, name)
        if value is not None and (not isinstance(value, str) or len(value) > ID_MAX_CHARS or not value.isprintable()):
            shown = repr(value) if isinstance(value, str) else type(value).__name__
            raise ValidationError(f"{name} must be printable text of at most {ID_MAX_CHARS} characters (or None), "
                                  f"got {shown[:60]}{'...' if len(shown) > 60 else ''}")


def _check_storable(value: Any, *, what: str) -> None:
    """Strings every database stores (no NUL, no lone surrogate) and string object keys, all the way down."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not is_storable(item):
                raise ValidationError(f"{what} holds text the database cannot store (NUL or a lone surrogate)")
        elif isinstance(item, Mapping):
            for key, child in item.items():
                if not isinstance(key, str):
                    raise ValidationError(f"{what} has a non-string object key {type(key).__name__}: JSON keys are strings")
                stack.append(key)
                stack.append(child)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _with_trace_context(event: Event, headers: dict[str, Any], max_message_bytes: int | None,
                        now_ms: int) -> dict[str, Any]:
    """``headers`` plus the current trace context (``celery_outbox.tracing``), so the relay and the
    consumers continue the writer's trace. Added after the event was judged on its own: the context
    never makes an event refused, it is left out when it would not fit the size limit."""
    traced = tracing.traced_headers(headers)
    if traced is headers or max_message_bytes is None:
        return traced
    envelope = Envelope(message_id=event.message_id, type=event.type, payload=event.payload, headers=traced,
                        created_at_ms=now_ms)
    try:
        celery_task_messages(envelope, targets=[], max_bytes=max_message_bytes)
    except MessageTooLargeError:
        return headers
    return traced


def add(session: Session, event: Event, *, tables: Tables, clock: Clock | None = None,
        max_message_bytes: int | None = None, known_types: Iterable[str] | None = None) -> OutboxRow:
    """Stage ``event`` as a pending outbox row in ``session`` (the caller commits).

    Validation is ``outbox_values``: nothing is added to the session for an event it refuses.
    """
    row = tables.outbox(**outbox_values(event, clock=clock, max_message_bytes=max_message_bytes,
                                        known_types=known_types))
    session.add(row)
    return row
