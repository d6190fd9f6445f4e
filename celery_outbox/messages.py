"""The wire contract between relay and consumers: the envelope and its Celery task message.

The relay publishes one Celery protocol-2 task message per (event, consumer) so each consumer is an
ordinary Celery task on its own queue: retries, acks_late and Flower work unchanged. The body is
JSON only; every publish gets a task id of its own (``task_id``), so a re-published duplicate is a
task of its own in Flower and in worker logs, and the inbox key (the message_id) travels in the body.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_outbox.errors import MalformedMessageError, MessageTooLargeError, SerializationError
from celery_outbox.task_route import check_exchange_type, check_names, check_properties

TASK_ID_NAMESPACE = uuid.UUID("7d1b1c6e-0c1e-4f0a-9a53-5a3f0c2d8e11")
REQUIRED_FIELDS = ("message_id", "type", "payload")
DEFAULT_MAX_JSON_DEPTH = 64  # Settings.max_json_depth; the default for callers that have no settings
TYPE_MAX_CHARS = 200  # the width of every ``type`` column
_MAX_CREATED_AT_MS = 2**63 - 1

# Untrusted JSON: the nesting is measured before ``json.loads`` runs, so a document nested past the
# interpreter's recursion limit is refused with a MalformedMessageError instead of a RecursionError
# (which Celery turns into a dropped message). Strings are skipped by the scanner; only brackets count.
# A string is the unrolled loop ``"`` plain* (escape plain*)* : the same matches as ``"(?:[^"\\]|\\.)*`` (each
# backslash takes the next character), without an alternation per character (2-3x faster on long text;
# tests/unit/test_fast_paths.py compares the two). An unclosed one runs to the end: linear.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_JSON_BRACKET = re.compile(r"[\[\]{}]")
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def json_depth_exceeds(text: str, max_depth: int) -> bool:
    """True when the JSON ``text`` nests arrays/objects deeper than ``max_depth`` (no recursion)."""
    if text.count("[") + text.count("{") <= max_depth:  # cannot nest deeper than it opens: no scan (the usual case)
        return False
    depth = 0
    for bracket in _JSON_BRACKET.findall(_JSON_STRING.sub("", text)):
        if bracket in "[{":
            depth += 1
            if depth > max_depth:
                return True
        else:
            depth -= 1
    return False


def check_depth(obj: Any, *, max_depth: int, what: str = "message") -> None:
    """Refuse an already decoded value nested deeper than ``max_depth`` (iterative, never recurses)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (Mapping, list, tuple)):
            if depth > max_depth:
                raise MalformedMessageError(f"{what} is nested deeper than {max_depth} levels")
            children = value.values() if isinstance(value, Mapping) else value
            stack.extend((child, depth + 1) for child in children)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    """A JSON number read as a float, refused when it overflows (``1e400``): it would be Infinity, which no
    JSON encoder writes back (a retry re-encoding it would send text that is not JSON)."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is out of the float range")
    return value


# Built once at import (immutable: its options never change). ``json.loads`` with a hook builds a decoder
# per call, which was a third of decoding a small envelope; ``decode_json`` keeps ``json.loads``'s one
# check that runs before the decoder (a leading BOM), so verdicts and messages are json.loads's
# (tests/unit/test_fast_paths.py compares them on hostile text).
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
_BOM = "\ufeff"


def decode_json(raw: str | bytes | bytearray, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH, what: str = "message") -> Any:
    """Decode untrusted JSON: strict UTF-8, no NaN/Infinity (nor a number that overflows to it, ``1e400``),
    nesting at most ``max_depth``.

    Every way it can fail is a ``MalformedMessageError`` saying what was wrong.
    """
    if isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise MalformedMessageError(f"{what} is not UTF-8: {e}") from None
    elif isinstance(raw, str):
        text = raw
    else:
        raise MalformedMessageError(f"{what} must be JSON text, got {type(raw).__name__}")
    if json_depth_exceeds(text, max_depth):
        raise MalformedMessageError(f"{what} is nested deeper than {max_depth} levels")
    try:
        if text.startswith(_BOM):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        return _DECODER.decode(text)
    except (ValueError, RecursionError) as e:
        raise MalformedMessageError(f"{what} is not JSON: {storable_text(str(e), limit=500)}") from None


def storable_text(text: str, *, limit: int | None = None) -> str:
    """``text`` as any database can store it: NUL and lone surrogates escaped (``\\x00``,
    ``\\ud800``), then cut to ``limit`` characters (with a marker) when given."""
    if _UNSTORABLE.search(text):
        text = _UNSTORABLE.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii")
                               if m.group() == "\x00" else f"\\u{ord(m.group()):04x}", text)
    if limit is not None and len(text) > limit:
        marker = f"... [{len(text) - limit} more characters]"
        text = text[: max(0, limit - len(marker))] + marker
        text = text[:limit]
    return text


def is_storable(text: str) -> bool:
    return _UNSTORABLE.search(text) is None



# A delivery the worker found malformed before Celery could unpack it travels to the consumer task
# as this one string: a prefix then base64 of a JSON object {"error", "body_b64", ...}. It is not
# JSON, so it can never be mistaken for an envelope, and it survives any transport unchanged.
MALFORMED_PREFIX = "outbox-malformed:v1:"


@dataclass(frozen=True, kw_only=True)
class MalformedDelivery:
    """A broker message that is not an outbox task message, as the consumer task receives it."""

    error: str
    body: bytes
    content_type: str | None = None
    content_encoding: str | None = None
    headers: Mapping[str, Any] = field(default_factory=dict)
    task_id: str | None = None

    def encode(self) -> str:
        doc = {"error": self.error, "body_b64": base64.b64encode(self.body).decode("ascii"),
               "content_type": self.content_type, "content_encoding": self.content_encoding,
               "headers": dict(self.headers), "task_id": self.task_id}
        return MALFORMED_PREFIX + base64.b64encode(encode_json(doc, what="malformed delivery").encode()).decode("ascii")

    @classmethod
    def decode(cls, text: str) -> MalformedDelivery | None:
        """The malformed delivery ``text`` carries, or None when it is not one (or is damaged)."""
        if not isinstance(text, str) or not text.startswith(MALFORMED_PREFIX):
            return None
        try:
            doc = json.loads(base64.b64decode(text[len(MALFORMED_PREFIX):], validate=True))
            body = base64.b64decode(doc["body_b64"], validate=True)
        except (ValueError, TypeError, KeyError, binascii.Error, RecursionError):
            return None
        if not isinstance(doc, dict):
            return None

        def text_or_none(v: Any) -> str | None:
            return storable_text(v, limit=200) if isinstance(v, str) else None

        headers = doc.get("headers")
        return cls(error=storable_text(str(doc.get("error") or "malformed message"), limit=2000), body=body,
                   content_type=text_or_none(doc.get("content_type")),
                   content_encoding=text_or_none(doc.get("content_encoding")),
                   headers=headers if isinstance(headers, dict) else {}, task_id=text_or_none(doc.get("task_id")))


def task_name(consumer: str) -> str:
    """The Celery task that runs ``consumer``; consumers register under exactly this name."""
    return f"consumers.{consumer}"


def task_id() -> str:
    """A new Celery task id for one publish of a message to a consumer (the relay's, a replay's).

    Unique per publish, never derived from (message_id, consumer): a duplicate delivery (a relay that
    crashed before marking, a reconcile pass, a replay) must be its own task to Celery and Flower, not
    overwrite the first delivery's entry. Nothing keys on it: the inbox, the delivery count and the
    dead-letter store key on the body's message_id (``delivery.delivery_key``); Celery's own retries
    of one delivery keep its id, so a delivery's retries stay on one entry.
    """
    return str(uuid.uuid4())


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
    def from_dict(cls, raw: Any, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH,
                  decoded_within: int | None = None) -> Envelope:
        """Validate a delivered body (a mapping, or JSON text). Anything off raises
        ``MalformedMessageError`` saying what: wrong types, a type the ``type`` columns cannot hold,
        JSON nested deeper than ``max_depth`` (in the body or in a payload sent as a string).

        ``decoded_within``: ``raw`` is a value ``decode_json`` returned with this ``max_depth``. It measured
        the text's nesting, which bounds the value's (duplicate keys can only drop levels), so when that
        bound is within ``max_depth`` the value is not walked again (a consumer's delivery decodes its body
        once for its message id, ``delivery._as_mapping``, then validates that value here)."""
        if isinstance(raw, (str, bytes, bytearray)):
            raw = decode_json(raw, max_depth=max_depth, what="envelope")
        elif decoded_within is None or decoded_within > max_depth:
            check_depth(raw, max_depth=max_depth, what="envelope")
        if not isinstance(raw, Mapping):
            raise MalformedMessageError(f"envelope must be a JSON object, got {type(raw).__name__}")
        missing = [f for f in REQUIRED_FIELDS if f not in raw]
        if missing:
            raise MalformedMessageError(f"envelope is missing field(s): {', '.join(missing)}")
        raw_id = raw["message_id"]
        if not isinstance(raw_id, (str, uuid.UUID)) or len(str(raw_id)) > 64:
            raise MalformedMessageError(f"message_id must be a UUID string, got {_short(raw_id)}")
        try:
            message_id = uuid.UUID(str(raw_id))
        except ValueError:
            raise MalformedMessageError(f"message_id {_short(raw_id)} is not a UUID") from None
        type_ = raw["type"]
        if not isinstance(type_, str) or not type_:
            raise MalformedMessageError(f"type must be a non-empty string, got {_short(type_)}")
        if len(type_) > TYPE_MAX_CHARS or not is_storable(type_) or not type_.isprintable():
            raise MalformedMessageError(
                f"type must be at most {TYPE_MAX_CHARS} printable characters, got {_short(type_)}")
        payload = raw["payload"]
        if isinstance(payload, str):
            # A payload that arrives as a string must itself be JSON; "not json" is poison.
            payload = decode_json(payload, max_depth=max_depth, what="payload")
        headers = raw.get("headers") or {}
        if not isinstance(headers, Mapping) or not all(isinstance(k, str) for k in headers):
            raise MalformedMessageError("headers must be a JSON object")
        created = raw.get("created_at_ms", 0)
        if isinstance(created, bool) or not isinstance(created, int) or not 0 <= created <= _MAX_CREATED_AT_MS:
            raise MalformedMessageError("created_at_ms must be an integer between 0 and 2**63-1")
        return cls(message_id=message_id, type=type_, payload=payload, headers=dict(headers),
                   created_at_ms=created)


def _short(value: Any) -> str:
    """A bounded, storable description of an untrusted value for an error message."""
    text = repr(value) if isinstance(value, (str, int, float, bool)) or value is None else f"a {type(value).__name__}"
    return storable_text(text, limit=120)


# One immutable encoder: ``json.dumps`` with non-default options builds a new one per call (the relay's hot loop).
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False, sort_keys=True)


def encode_json(obj: Any, *, what: str = "message") -> str:
    """Strict JSON (no NaN, no default hook): what cannot be encoded is refused, never pickled."""
    try:
        return _ENCODER.encode(obj)
    except (TypeError, ValueError) as e:
        raise SerializationError(f"{what} cannot be encoded as JSON: {e}") from None


def check_size(encoded: str | bytes, *, limit: int, what: str = "message") -> None:
    if isinstance(encoded, str) and len(encoded) * 4 <= limit:
        return  # UTF-8 spends at most 4 bytes per character: no need to encode to know it fits
    size = len(encoded.encode("utf-8", "surrogatepass") if isinstance(encoded, str) else encoded)
    if size > limit:
        raise MessageTooLargeError(f"{what} is {size} bytes, over the limit of {limit} bytes")


@dataclass(frozen=True, kw_only=True)
class QueueSpec:
    """A queue as the relay declares it before its first publish to it (plain data: no kombu here).

    Captured at enqueue time from the Celery app's own ``Queue`` (``task_queues``), so the relay
    declares exactly what the workers declare (arguments included: RabbitMQ refuses a redeclaration
    with other arguments); Redis drops a message sent to an exchange with no bound queue.
    """

    name: str
    exchange: str
    exchange_type: str = "direct"
    routing_key: str = ""
    durable: bool = True
    auto_delete: bool = False
    exclusive: bool = False
    arguments: dict[str, Any] | None = None
    max_priority: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "exchange": self.exchange, "exchange_type": self.exchange_type,
                "routing_key": self.routing_key, "durable": self.durable, "auto_delete": self.auto_delete,
                "exclusive": self.exclusive, "arguments": self.arguments, "max_priority": self.max_priority}

    @classmethod
    def from_dict(cls, raw: Any) -> QueueSpec:
        """Validate a stored declaration; anything off is a ``MalformedMessageError``."""
        if not isinstance(raw, Mapping):
            raise MalformedMessageError("queue declaration must be a JSON object")
        name, exchange = raw.get("name"), raw.get("exchange", "")
        routing_key, exchange_type = raw.get("routing_key", ""), raw.get("exchange_type", "direct")
        if not (isinstance(name, str) and name and isinstance(exchange, str) and isinstance(routing_key, str)
                and isinstance(exchange_type, str) and exchange_type):
            raise MalformedMessageError("queue declaration needs a name, an exchange, a type and a routing key")
        flags = {k: raw.get(k, d) for k, d in (("durable", True), ("auto_delete", False), ("exclusive", False))}
        if not all(isinstance(v, bool) for v in flags.values()):
            raise MalformedMessageError("queue declaration flags must be booleans")
        arguments, max_priority = raw.get("arguments"), raw.get("max_priority")
        if arguments is not None and not isinstance(arguments, dict):
            raise MalformedMessageError("queue arguments must be a JSON object")
        if max_priority is not None and (isinstance(max_priority, bool) or not isinstance(max_priority, int)):
            raise MalformedMessageError("queue max_priority must be an integer")
        return cls(name=name, exchange=exchange, exchange_type=exchange_type, routing_key=routing_key,
                   arguments=arguments, max_priority=max_priority, **flags)


@dataclass(frozen=True, kw_only=True)
class TaskMessage:
    """One broker message: Celery protocol 2 headers and a JSON body, ready for kombu.

    An event's message goes to the namespace's events exchange (``exchange`` None) and its consumer's
    queue; a task enqueued through the outbox (``task_row_message``) carries its own ``exchange``
    (``""``: the default exchange), routing key and ``queue`` to declare, as Celery resolved them.
    ``consumer`` is the consumer's name for an event, the task's name for a task.
    """

    consumer: str
    routing_key: str
    body: str
    headers: dict[str, Any]
    properties: dict[str, Any]
    exchange: str | None = None
    queue: QueueSpec | None = None
    delivery_mode: int = 2

    @property
    def message_id(self) -> str:
        """The outbox message id this broker message carries (an event's header, a task's own id)."""
        return str(self.headers.get("outbox_message_id") or self.headers.get("id"))


# -- tasks enqueued through the outbox ------------------------------------------------------------
# A row whose ``headers["outbox_kind"] == "task"`` holds a Celery task message exactly as Celery built
# it (celery_outbox/celery/enqueue.py): payload {"body": [args, kwargs, embed]}, headers {"task_headers",
# "properties", "exchange", "routing_key", "queue", "priority", "delivery_mode"}. JSON only.
TASK_KIND = "task"
# Message properties the relay passes to kombu; anything else a row holds is ignored.
TASK_PROPERTIES = ("correlation_id", "reply_to", "priority", "expiration", "message_id", "user_id", "app_id",
                   "timestamp")


def is_task_row(headers: Mapping[str, Any] | None) -> bool:
    return isinstance(headers, Mapping) and headers.get("outbox_kind") == TASK_KIND


def task_row_message(*, message_id: uuid.UUID | str, type: str, payload: Any, headers: Mapping[str, Any],
                     max_bytes: int | None = None) -> TaskMessage:
    """The one broker message of a task row. Raises ``MalformedMessageError`` for a row that is not
    a task message, ``SerializationError``/``MessageTooLargeError`` for one that cannot go out."""
    body = payload.get("body") if isinstance(payload, Mapping) else None
    if not isinstance(body, list) or len(body) != 3 or not isinstance(body[0], list) \
            or not isinstance(body[1], Mapping) or not (body[2] is None or isinstance(body[2], Mapping)):
        raise MalformedMessageError("task row payload must be {\"body\": [args, kwargs, embed]}")
    task_headers = headers.get("task_headers")
    if not isinstance(task_headers, Mapping) or task_headers.get("task") != type \
            or str(task_headers.get("id")) != str(message_id):
        raise MalformedMessageError("task row headers must name the row's task and carry its id as the task id")
    exchange, routing_key = headers.get("exchange", ""), headers.get("routing_key", "")
    if not isinstance(exchange, str) or not isinstance(routing_key, str) or not (exchange or routing_key):
        raise MalformedMessageError("task row needs an exchange or a routing key")
    raw_queue = headers.get("queue")
    queue = None if raw_queue is None else QueueSpec.from_dict(raw_queue)
    raw_props = headers.get("properties") or {}
    if not isinstance(raw_props, Mapping):
        raise MalformedMessageError("task row properties must be a JSON object")
    properties = {k: raw_props[k] for k in TASK_PROPERTIES if raw_props.get(k) is not None}
    properties.setdefault("correlation_id", str(message_id))
    # what no broker client encodes fails every batch the row is in: judged here, dead-lettered as unpublishable
    check_names([("exchange", exchange), ("routing key", routing_key)] + ([] if queue is None else [
        ("queue name", queue.name), ("queue exchange", queue.exchange), ("queue routing key", queue.routing_key)]))
    check_properties(properties)
    if queue is not None:
        check_exchange_type(queue.exchange_type)
    delivery_mode = headers.get("delivery_mode", 2)
    if delivery_mode not in (1, 2):
        delivery_mode = 2
    encoded = encode_json(body, what=f"task {type} arguments")
    if max_bytes is not None:
        check_size(encoded, limit=max_bytes, what=f"task {type} message")
    return TaskMessage(consumer=type, routing_key=routing_key, body=encoded, headers=dict(task_headers),
                       properties=properties, exchange=exchange, queue=queue, delivery_mode=delivery_mode)


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
    common: dict[str, Any] = {
        "lang": "py", "parent_id": None, "group": None, "retries": 0, "eta": None, "expires": None,
        "timelimit": [None, None], "argsrepr": f"({envelope.type} {message_id})", "kwargsrepr": "{}",
        "origin": "outbox-relay", "ignore_result": True, "outbox_message_id": message_id, "outbox_type": envelope.type,
    }
    out = []
    for consumer, routing_key in targets:
        tid = task_id()
        headers = common.copy()
        headers["task"] = task_name(consumer)
        headers["id"] = headers["root_id"] = tid
        out.append(TaskMessage(consumer=consumer, routing_key=routing_key, body=body, headers=headers,
                               properties={"correlation_id": tid, "message_id": message_id}))
    return out
