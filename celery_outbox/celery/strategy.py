"""The worker-side gate of every consumer task: no broker message can crash, stall or bypass it.

Why a task ``Strategy`` (and not a consumer bootstep or an ``on_message`` hook): Celery's worker
calls a task's strategy with the raw kombu message *before* anything of Celery's own unpacking runs
(``Request.__init__`` splits the body into ``args, kwargs, embed`` in the worker's main process, and
an exception there that is not ``InvalidTaskError`` stops the worker with "Unrecoverable error";
the message is then restored and kills every restarted worker). The strategy is named by the task
itself (``Task.Strategy``), so it is set for our consumer tasks only, needs no change to the
worker's consumer blueprint, and cannot be lost by an application that configures its own
``worker_consumer`` or bootsteps. A bootstep/``on_message`` hook would have to replace Celery's
internal ``create_task_handler`` for every task of the app.

What it does, for every message routed to a consumer task (first deliveries, Celery retries and
broker redeliveries alike): it reads the raw body itself (content type and encoding, size, strict
UTF-8, JSON nesting bounded by ``Settings.max_json_depth``, the exact protocol-2 shape
``[[envelope], {}, {no callbacks}]``) and hands Celery a *canonical* message it built from scratch:
our task name, a UUID task id, no expiry, no callbacks, no foreign time limit, an ETA only within
the consumer's backoff, the consumer's own queue, and as the single argument the envelope as JSON
*text* (decoded later by ``Envelope.from_dict`` with the same depth bound; kombu's JSON type hooks,
which turn ``{"__type__": ..., "__value__": ...}`` objects into bytes or datetimes, never see it).
A body framed exactly as the relay writes it hands over its envelope text as it came (decoded once
here to check it, never encoded again: ``_relay_envelope``); the pool decodes it once more.

A message that fails any check is not rejected or dropped: its single argument becomes a
``messages.MalformedDelivery`` (raw bytes kept, the reason, sanitised broker headers), and the
consumer task runs ``delivery.deliver`` on it like any other delivery: counted in the database,
retried with backoff, dead-lettered after the consumer's maximum deliveries and then acked. So the
database work happens in the pool under the task's time limit, and a database that is down while a
poison message arrives costs a redelivery, never the message. Messages on a consumer queue that do
not name a consumer task at all (no ``task`` header, an unknown task) never reach this strategy: the
worker-wide gate (``celery_outbox.celery.gate``) dead-letters those, and guards every other task.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import re
import uuid
from collections.abc import Callable, Mapping
from json.encoder import encode_basestring_ascii
from types import MappingProxyType
from typing import Any

from celery.exceptions import InvalidTaskError
from celery.worker.strategy import default

from celery_outbox.errors import MalformedMessageError as Bad
from celery_outbox.errors import OutboxError
from celery_outbox.inbox.dead_letters import storable_headers
from celery_outbox.messages import (
    TASK_ID_NAMESPACE,
    MalformedDelivery,
    decode_json,
    encode_json,
    json_depth_exceeds,
    storable_text,
)
from celery_outbox.settings import Settings

log = logging.getLogger(__name__)

STRATEGY = "celery_outbox.celery.strategy:guarded"
CONTENT_TYPE = "application/json"
CONTENT_ENCODINGS = ("utf-8", "utf8")
EMBED: Mapping[str, None] = MappingProxyType({"callbacks": None, "errbacks": None, "chain": None, "chord": None})
MAX_RETRIES_HEADER = 1_000_000
# The envelope sits two levels down in the protocol-2 body ([[envelope], {}, {}]).
_BODY_LEVELS = 2
# The envelope travels as an escaped JSON string after the first Celery retry, which can nearly
# double its size; the envelope itself is held to ``max_message_bytes`` by ``deliver``.
_BODY_SLACK_BYTES = 64 * 1024
# A UUID already in the spelling ``str(uuid.UUID(...))`` gives: kept as it is, not parsed again.
_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# What the pool decodes: compact JSON, as ``json.dumps(payload, separators=(",", ":"))`` writes it.
_PAYLOAD_ENCODER = json.JSONEncoder(separators=(",", ":"))
# A body exactly as the relay writes it (``messages.celery_task_messages``: compact, keys sorted) is
# ``[[`` + the envelope's JSON text + this tail; ``_relay_envelope`` reads the envelope text out of it.
_RELAY_HEAD = b"[[{"
# The full path's re-encode is at most 4.5x the text it read (``1e15`` -> ``1000000000000000.0``; a
# two-byte character -> ``\u00e9``); a body this much under ``max_message_bytes`` fits the pool's size
# check either way, so the text it hands over cannot change that verdict. Larger bodies take the full path.
_MAX_REENCODE_GROWTH = 8
_RELAY_TAIL = "],{}," + encode_json(dict(EMBED)) + "]"
# The canonical body ``[[arg], {}, no callbacks]`` is ``_PAYLOAD_ENCODER``'s text of it, written around the
# one escaped string (``single_argument_body``): the same text, without the encoder walking the triple.
_SINGLE_ARGUMENT_TAIL = "],{}," + _PAYLOAD_ENCODER.encode(dict(EMBED)) + "]"


def single_argument_body(arg: str) -> str:
    """``_PAYLOAD_ENCODER.encode([[arg], {}, dict(EMBED)])``, the body the pool decodes (the same text)."""
    return "[[" + encode_basestring_ascii(arg) + _SINGLE_ARGUMENT_TAIL


def body_limit(settings: Settings) -> int:
    """The largest raw broker body a consumer task reads at all."""
    return 2 * settings.max_message_bytes + _BODY_SLACK_BYTES


def guarded(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., Any]:
    """``Task.Strategy`` of consumer tasks: Celery's default strategy behind ``canonical_message``."""
    inner = default(task, app, consumer, **kwargs)
    settings: Settings = task.outbox_settings
    max_eta_s: float = task.outbox_max_eta_s
    route = _route(app, task.outbox_queue)

    def task_message_handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any) -> Any:
        canonical = canonical_message(message, task_name=task.name, settings=settings, route=route,
                                      max_eta_s=max_eta_s)
        try:
            return inner(canonical, None, ack, reject, callbacks)
        except InvalidTaskError:
            raise
        except Exception as e:  # only a bug of ours can land here; Celery rejects instead of dying
            log.exception("outbox: could not hand a consumer message to Celery")
            raise InvalidTaskError(f"outbox strategy failed: {e.__class__.__name__}") from e

    return task_message_handler


def _route(app: Any, queue_name: str) -> tuple[str | None, str | None]:
    """The consumer's own exchange and routing key (where Celery's retry republishes)."""
    try:
        queue = app.amqp.queues[queue_name]
        return queue.exchange.name, queue.routing_key
    except Exception:  # no such queue configured: keep what the broker said
        return None, None


class CanonicalMessage:
    """The kombu message Celery's default strategy sees: built by us, attributes only.

    Anything else (``ack``, ``reject``, ``channel``...) is the broker's original message."""

    content_type = CONTENT_TYPE
    content_encoding = "utf-8"

    def __init__(self, original: Any, *, headers: dict[str, Any], payload: list[Any],
                 delivery_info: dict[str, Any], properties: dict[str, Any], body: str | bytes | None = None) -> None:
        self._original = original
        self.headers = headers
        self.payload = payload
        # ``body``: the JSON text of ``payload`` when the caller has it already (the gate passes the raw
        # body it decoded ``payload`` from: the pool decodes the same value, no re-encode here).
        self.body = _PAYLOAD_ENCODER.encode(payload) if body is None else body
        self.delivery_info = delivery_info
        self.properties = properties

    def decode(self) -> list[Any]:
        return self.payload

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


def raw_bytes(message: Any) -> bytes:
    """The message body as the publisher sent it. py-amqp (RabbitMQ) hands over a body already
    decoded by its declared ``content_encoding`` when that codec accepts it; encoding it back with
    the same codec gives the original bytes."""
    body = getattr(message, "body", None)
    if body is None:
        return b""
    if isinstance(body, str):
        encoding = getattr(message, "content_encoding", None)
        if isinstance(encoding, str) and encoding.lower() not in CONTENT_ENCODINGS:
            try:
                return body.encode(encoding)
            except (LookupError, UnicodeError, ValueError, TypeError):
                pass
        return body.encode("utf-8", "surrogatepass")
    try:
        return bytes(body)
    except Exception:
        return storable_text(repr(type(body))).encode()


def canonical_message(message: Any, *, task_name: str, settings: Settings, route: tuple[str | None, str | None],
                      max_eta_s: float, now: dt.datetime | None = None) -> CanonicalMessage:
    """The message as Celery will see it: valid by construction, the poison wrapped (module docstring).

    Never raises: whatever the message holds, the answer is a canonical message."""
    try:
        raw = raw_bytes(message)
    except Exception as e:
        raw = f"<body unreadable: {e.__class__.__name__}>".encode()
    try:
        headers_in = message.headers
    except Exception:
        headers_in = None
    headers = headers_in if isinstance(headers_in, Mapping) else {}
    tid = stable_task_id(headers.get("id"), raw)
    eta = None
    try:
        arg = _envelope_text(message, raw, headers_in, task_name=task_name, settings=settings)
        eta = _eta(headers.get("eta"), max_eta_s=max_eta_s, now=now)
    except OutboxError as e:
        arg = malformed_text(message, raw, headers_in, tid, str(e), settings)
    except Exception as e:  # anything unforeseen is still only this message's problem
        arg = malformed_text(message, raw, headers_in, tid, f"unreadable message ({e.__class__.__name__}: {e})", settings)
    canonical_headers: dict[str, Any] = {
        "lang": "py", "task": task_name, "id": tid, "root_id": tid, "parent_id": None, "group": None,
        "retries": _retries(headers.get("retries")), "eta": eta, "expires": None, "timelimit": [None, None],
        "argsrepr": _text_header(headers.get("argsrepr")) or f"({tid})", "kwargsrepr": "{}",
        "origin": _text_header(headers.get("origin")), "ignore_result": True,
    }
    info = mapping_attr(message, "delivery_info")
    exchange, routing_key = route
    if exchange is None:
        exchange = _text_header(info.get("exchange"))
        routing_key = _text_header(info.get("routing_key"))
    properties = mapping_attr(message, "properties")
    priority = properties.get("priority")
    return CanonicalMessage(
        message, headers=canonical_headers, payload=[[arg], {}, dict(EMBED)], body=single_argument_body(arg),
        delivery_info={"exchange": exchange, "routing_key": routing_key,
                       "redelivered": info.get("redelivered") is True, "priority": None},
        properties={"correlation_id": tid,
                    "priority": priority if isinstance(priority, int) and not isinstance(priority, bool)
                    and 0 <= priority <= 255 else None},
    )


def _envelope_text(message: Any, raw: bytes, headers: Any, *, task_name: str, settings: Settings) -> str:
    """The single argument of a well-formed message, as JSON text; raises OutboxError saying why not."""
    if not isinstance(headers, Mapping):
        raise Bad(f"headers must be a mapping, got {type(headers).__name__}")
    if headers.get("task") != task_name:
        raise Bad(f"not a Celery protocol 2 message for {task_name} (task header "
                  f"{storable_text(repr(headers.get('task')), limit=120)})")
    content_type = getattr(message, "content_type", None)
    if not isinstance(content_type, str) or content_type.lower() != CONTENT_TYPE:
        raise Bad(f"content type must be {CONTENT_TYPE}, got {storable_text(repr(content_type), limit=120)}")
    encoding = getattr(message, "content_encoding", None)
    if not isinstance(encoding, str) or encoding.lower() not in CONTENT_ENCODINGS:
        raise Bad(f"content encoding must be utf-8, got {storable_text(repr(encoding), limit=120)}")
    if len(raw) > body_limit(settings):
        raise Bad(f"message body is {len(raw)} bytes, over the limit of {body_limit(settings)} bytes")
    relayed = _relay_envelope(raw, settings)
    if relayed is not None:
        return relayed
    body = decode_json(raw, max_depth=settings.max_json_depth + _BODY_LEVELS, what="message body")
    if not (isinstance(body, list) and len(body) == 3):
        raise Bad("message body must be the protocol 2 triple [args, kwargs, embed]")
    args, kwargs, embed = body
    if not (isinstance(args, list) and len(args) == 1):
        raise Bad("args must be a list holding exactly the envelope")
    if kwargs != {}:
        raise Bad("kwargs must be empty")
    if embed is not None and not (isinstance(embed, dict) and set(embed) <= set(EMBED) and not any(embed.values())):
        raise Bad("embed must carry no callbacks, errbacks, chain or chord")
    envelope = args[0]
    return envelope if isinstance(envelope, str) else encode_json(envelope, what="envelope")


def _relay_envelope(raw: bytes, settings: Settings) -> str | None:
    """The envelope's JSON text of a body framed exactly as the relay writes it, else None.

    ``[[`` + T + ``],{},{embed}]`` is the triple ``[[envelope], {}, no callbacks]`` exactly when T is one
    JSON value (JSON values delimit themselves), and its depth is the body's less the two outer levels:
    decoding T alone checks what decoding the body would, and T itself is the argument the pool reads,
    with no re-encode. Anything else (not this frame, not UTF-8, T not JSON or too deep, a number that
    reads as infinite, a body near the size limit) is None: the full decode of ``_envelope_text`` then
    decides, with its own error."""
    if len(raw) * _MAX_REENCODE_GROWTH > settings.max_message_bytes or not raw.startswith(_RELAY_HEAD):
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not text.endswith(_RELAY_TAIL):
        return None
    inner = text[2 : len(text) - len(_RELAY_TAIL)]
    if json_depth_exceeds(inner, settings.max_json_depth):
        return None
    try:
        _ENVELOPE_DECODER.decode(inner)
    except (ValueError, RecursionError):
        return None
    return inner


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e400: the full path's re-encode refuses it, so the full path decides
        raise ValueError("a number out of the float range")
    return value


# ``messages.decode_json``'s rules (strict JSON, no NaN/Infinity; the depth is checked before), and
# finite numbers: what it accepts is what the full path accepts, anything else takes the full path.
_ENVELOPE_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


def malformed_text(message: Any, raw: bytes, headers: Any, tid: str, error: str, settings: Settings, *,
                   whole: bool = False) -> str:
    """The ``MalformedDelivery`` argument of a malformed message. A consumer task carries it through its own
    retries, so its body is cut to ``max_message_bytes`` (the error says so); ``whole`` keeps every byte
    (the task gate's poison task writes it at once: celery/gate.py)."""
    keep = raw if whole else raw[: settings.max_message_bytes]
    if len(keep) < len(raw):
        error += f" (body cut to its first {len(keep)} of {len(raw)} bytes)"

    def attr(name: str) -> str | None:
        value = getattr(message, name, None)
        return storable_text(value, limit=200) if isinstance(value, str) else None

    return MalformedDelivery(
        error=storable_text(f"malformed broker message: {error}", limit=2000), body=keep,
        content_type=attr("content_type"), content_encoding=attr("content_encoding"),
        headers=storable_headers(headers), task_id=tid,
    ).encode()


def mapping_attr(message: Any, name: str) -> Mapping[str, Any]:
    try:
        value = getattr(message, name, None)
    except Exception:
        return {}
    return value if isinstance(value, Mapping) else {}


def stable_task_id(value: Any, raw: bytes) -> str:
    """The message's task id when it is a UUID; else one derived from the body (stable on redelivery)."""
    if isinstance(value, str) and _CANONICAL_UUID.fullmatch(value):
        return value  # what str(uuid.UUID(value)) would give (the relay's ids are canonical)
    if isinstance(value, str) and len(value) <= 64:
        try:
            return str(uuid.UUID(value))
        except ValueError:
            pass
    return str(uuid.uuid5(TASK_ID_NAMESPACE, "raw:" + raw.hex()))


def _retries(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_RETRIES_HEADER:
        return value
    return 0


def _text_header(value: Any) -> str | None:
    return storable_text(value, limit=200) if isinstance(value, str) else None


def _eta(value: Any, *, max_eta_s: float, now: dt.datetime | None) -> str | None:
    """A Celery retry's ETA, kept when readable and at most ``max_eta_s`` ahead (else clamped to it)."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        eta = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    if eta.tzinfo is None:
        eta = eta.replace(tzinfo=dt.UTC)
    current = now or dt.datetime.now(dt.UTC)
    try:
        latest = current + dt.timedelta(seconds=max_eta_s)
        return min(eta, latest).astimezone(dt.UTC).isoformat()
    except (OverflowError, ValueError):
        return None
