"""The wire contract between relay and consumers: the envelope and its Celery task message.

The relay publishes one Celery protocol-2 task message per (event, consumer) so each consumer is an
ordinary Celery task on its own queue: retries, acks_late and Flower work unchanged. The body is
JSON only; the task id is derived from (message_id, consumer), so a re-published duplicate carries
the same id and the inbox key travels in the body.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_outbox.errors import MalformedMessageError, MessageTooLargeError, SerializationError

TASK_ID_NAMESPACE = uuid.UUID("7d1b1c6e-0c1e-4f0a-9a53-5a3f0c2d8e11")
REQUIRED_FIELDS = ("message_id", "type", "payload")


def task_name(consumer: str) -> str:
    """The Celery task that runs ``consumer``; consumers register under exactly this name."""
    return f"consumers.{consumer}"


def task_id(message_id: uuid.UUID | str, consumer: str) -> str:
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"{message_id}/{consumer}"))


@dataclass(frozen=True, kw_only=True)
class Envelope:
    """What a consumer receives: the outbox row minus the relay's bookkeeping."""

    message_id: uuid.UUID
    type: str
    payload: Any
    headers: Mapping[str, Any] = field(default_factory=dict)
    created_at_ms: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "message_id": str(self.message_id),
            "type": self.type,
            "payload": self.payload,
            "headers": dict(self.headers),
            "created_at_ms": self.created_at_ms,
        }

    @classmethod
    def from_dict(cls, raw: Any) -> Envelope:
        """Validate a delivered body. Anything off raises ``MalformedMessageError`` saying what."""
        if isinstance(raw, (str, bytes)):
            try:
                raw = json.loads(raw)
            except ValueError as e:
                raise MalformedMessageError(f"envelope is not JSON: {e}") from None
        if not isinstance(raw, Mapping):
            raise MalformedMessageError(f"envelope must be a JSON object, got {type(raw).__name__}")
        missing = [f for f in REQUIRED_FIELDS if f not in raw]
        if missing:
            raise MalformedMessageError(f"envelope is missing field(s): {', '.join(missing)}")
        try:
            message_id = uuid.UUID(str(raw["message_id"]))
        except ValueError:
            raise MalformedMessageError(f"message_id {raw['message_id']!r} is not a UUID") from None
        type_ = raw["type"]
        if not isinstance(type_, str) or not type_:
            raise MalformedMessageError(f"type must be a non-empty string, got {type_!r}")
        payload = raw["payload"]
        if isinstance(payload, str):
            # A payload that arrives as a string must itself be JSON; "not json" is poison.
            try:
                payload = json.loads(payload)
            except ValueError as e:
                raise MalformedMessageError(f"payload is not JSON: {e}") from None
        headers = raw.get("headers") or {}
        if not isinstance(headers, Mapping):
            raise MalformedMessageError("headers must be a JSON object")
        created = raw.get("created_at_ms", 0)
        if not isinstance(created, int):
            raise MalformedMessageError("created_at_ms must be an integer")
        return cls(message_id=message_id, type=type_, payload=payload, headers=dict(headers),
                   created_at_ms=created)


def encode_json(obj: Any, *, what: str = "message") -> str:
    """Strict JSON (no NaN, no default hook): what cannot be encoded is refused, never pickled."""
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise SerializationError(f"{what} cannot be encoded as JSON: {e}") from None


def check_size(encoded: str | bytes, *, limit: int, what: str = "message") -> None:
    size = len(encoded.encode() if isinstance(encoded, str) else encoded)
    if size > limit:
        raise MessageTooLargeError(f"{what} is {size} bytes, over the limit of {limit} bytes")


@dataclass(frozen=True, kw_only=True)
class TaskMessage:
    """One broker message: Celery protocol 2 headers and a JSON body, ready for kombu."""

    consumer: str
    routing_key: str
    body: str
    headers: dict[str, Any]
    properties: dict[str, Any]


def celery_task_message(envelope: Envelope, *, consumer: str, routing_key: str,
                        max_bytes: int | None = None) -> TaskMessage:
    """Build the task message for ``consumer``; raises Serialization/MessageTooLarge errors."""
    return celery_task_messages(envelope, targets=[(consumer, routing_key)], max_bytes=max_bytes)[0]


_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def celery_task_messages(envelope: Envelope, *, targets: Sequence[tuple[str, str]],
                         max_bytes: int | None = None) -> list[TaskMessage]:
    """One task message per ``(consumer, routing_key)``. The body does not depend on the consumer,
    so it is encoded once per event (the relay's hottest loop), only the headers differ."""
    body = encode_json([[envelope.to_dict()], {}, _EMBED])
    if max_bytes is not None:
        check_size(body, limit=max_bytes)
    message_id = str(envelope.message_id)
    argsrepr = f"({envelope.type} {message_id})"
    out = []
    for consumer, routing_key in targets:
        tid = task_id(envelope.message_id, consumer)
        headers: dict[str, Any] = {
            "lang": "py",
            "task": task_name(consumer),
            "id": tid,
            "root_id": tid,
            "parent_id": None,
            "group": None,
            "retries": 0,
            "eta": None,
            "expires": None,
            "timelimit": [None, None],
            "argsrepr": argsrepr,
            "kwargsrepr": "{}",
            "origin": "outbox-relay",
            "ignore_result": True,
            "outbox_message_id": message_id,
            "outbox_type": envelope.type,
        }
        out.append(TaskMessage(consumer=consumer, routing_key=routing_key, body=body, headers=headers,
                               properties={"correlation_id": tid, "message_id": message_id}))
    return out
