"""The relay's lean publish on py-amqp: the same frames as kombu's ``Producer.publish``, less Python per message.

Per message, kombu's ``Producer.publish`` and py-amqp's property encoder were most of the relay's
publish time (docs/benchmarks.md, "The relay per wake-up: where the ms go, and the lean publish"):
py-amqp encodes the Celery headers table item by item through a ``BytesIO`` and ``isinstance`` checks. ``LeanMessage`` encodes the
same basic properties into the same bytes (``encode_properties``: the order of ``amqp.Message.PROPERTIES``,
the same type codes for strings, booleans, numbers, tables, arrays and None) with one join, and falls
back to py-amqp's own encoder for anything else (a value of a type it does not know, a key too long),
which then encodes or raises exactly as it always did. ``event_message`` and ``task_message`` build the
message kombu would build from the same ``TaskMessage`` (body encoded to UTF-8, ``content_type``
``application/json``, priority 0, the delivery mode); tests/unit/test_amqp_wire.py checks both, byte for
byte, against kombu's.
"""

from __future__ import annotations

from struct import Struct
from typing import Any

import amqp
from kombu.entity import maybe_delivery_mode

from celery_outbox.messages import TaskMessage

_OCTET = Struct("B").pack
_SHORT = Struct(">H").pack
_LONG = Struct(">I").pack
_LONGLONG = Struct(">Q").pack
_INT = Struct(">ci").pack
_BIGINT = Struct(">cq").pack
_DOUBLE = Struct(">cd").pack
_INT32_MAX = 2147483647
# (flag bit, property, type): ``amqp.Message.PROPERTIES`` in order, the first at bit 15.
_PROPERTIES = tuple((1 << (15 - i), name, kind) for i, (name, kind) in enumerate(amqp.Message.PROPERTIES))
# Task properties a lean publish passes through unchanged; kombu rewrites ``priority`` and ``expiration``
# (and a ``timestamp`` is encoded from a datetime), so a task that carries them goes through kombu.
PLAIN_TASK_PROPERTIES = frozenset({"correlation_id", "reply_to", "message_id", "user_id", "app_id"})


class _Unknown(Exception):
    """A value this encoder does not know: py-amqp's encoder takes the whole message."""


def _key(k: Any) -> bytes:
    raw = k.encode("utf-8", "surrogatepass") if isinstance(k, str) else k
    return _OCTET(len(raw)) + raw


def _item(v: Any, out: list[bytes]) -> None:
    t = type(v)
    if t is str:
        raw = v.encode("utf-8", "surrogatepass")
        out.append(b"S" + _LONG(len(raw)))
        out.append(raw)
    elif v is None:
        out.append(b"V")
    elif t is bool:
        out.append(b"t\x01" if v else b"t\x00")
    elif t is int:
        out.append(_BIGINT(b"L", v) if v > _INT32_MAX or v < -_INT32_MAX else _INT(b"I", v))
    elif t is dict:
        out.append(b"F")
        _table(v, out)
    elif t is list or t is tuple:
        items: list[bytes] = []
        for x in v:
            _item(x, items)
        data = b"".join(items)
        out.append(b"A" + _LONG(len(data)))
        out.append(data)
    elif t is bytes:
        out.append(b"S" + _LONG(len(v)))
        out.append(v)
    elif t is float:
        out.append(_DOUBLE(b"d", v))
    else:
        raise _Unknown(t.__name__)


def _table(d: dict[Any, Any], out: list[bytes]) -> None:
    parts: list[bytes] = []
    for k, v in d.items():
        parts.append(_key(k))
        _item(v, parts)
    data = b"".join(parts)
    out.append(_LONG(len(data)))
    out.append(data)


def encode_properties(props: dict[str, Any]) -> bytes:
    """The property flags and list of a basic content header, as ``amqp.Message._serialize_properties``.

    Raises ``_Unknown`` (or ``struct.error``) for what it does not encode; ``LeanMessage`` then asks py-amqp.
    """
    flags = 0
    out: list[bytes] = []
    for bit, name, kind in _PROPERTIES:
        v = props.get(name)
        if v is None:
            continue
        flags |= bit
        if kind == "s":
            raw = (v or "").encode("utf-8", "surrogatepass") if isinstance(v or "", str) else v
            out.append(_OCTET(len(raw)))
            out.append(raw)
        elif kind == "F":
            _table(v or {}, out)
        elif kind == "o":
            out.append(_OCTET(v))
        elif kind == "L":
            out.append(_LONGLONG(v))
        else:
            raise _Unknown(kind)
    return _SHORT(flags) + b"".join(out)


class LeanMessage(amqp.Message):
    """An ``amqp.Message`` whose header frame's properties are encoded by ``encode_properties``."""

    __slots__ = ()

    def __init__(self, body: bytes = b"", **properties: Any) -> None:
        super().__init__(body, **properties)  # type: ignore[no-untyped-call]

    def _serialize_properties(self) -> bytes:
        try:
            return encode_properties(self.properties)
        except Exception:  # anything it does not know: py-amqp's encoder, which encodes or raises as ever
            encoded: bytes = super()._serialize_properties()  # type: ignore[no-untyped-call]
            return encoded


def event_message(m: TaskMessage) -> LeanMessage:
    """What kombu's ``Producer.publish`` builds for an event message (``exchange`` None)."""
    return LeanMessage(m.body.encode("utf-8"), priority=0, content_type="application/json",
                       content_encoding="utf-8", application_headers=m.headers, delivery_mode=2, **m.properties)


def task_message(m: TaskMessage, *, default_delivery_mode: Any) -> LeanMessage | None:
    """What kombu's ``Producer.publish`` builds for a task enqueued through the outbox; None when its
    properties are not all ``PLAIN_TASK_PROPERTIES`` (kombu then publishes it)."""
    if not PLAIN_TASK_PROPERTIES.issuperset(m.properties):
        return None
    return LeanMessage(m.body.encode("utf-8"), priority=0, content_type="application/json",
                       content_encoding="utf-8", application_headers=m.headers,
                       delivery_mode=maybe_delivery_mode(m.delivery_mode or default_delivery_mode), **m.properties)
