"""Where a task row goes and the message properties it carries: what every broker the relay serves takes.

One rule for the two places that judge a task row: enqueue refuses a task whose route or properties break it
(celery/enqueue.py), and the relay dead-letters a stored row that breaks it as unpublishable
(``messages.task_row_message``). RabbitMQ's protocol (AMQP 0-9-1) carries names and text properties as short
strings of at most 255 UTF-8 bytes, the priority as one octet and the timestamp as an unsigned 64-bit integer;
the client fails to encode anything else, and a message that cannot be encoded fails every batch it is in, so
the relay would publish nothing behind it. A negative expiration is refused by the broker for the channel,
which the relay takes for a broker outage. docs/tasks.md ("Transactional enqueue") says what is refused.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from celery_outbox.errors import MalformedMessageError, ValidationError

SHORT_STR_BYTES = 255  # an AMQP 0-9-1 short string: exchange, routing key and queue names, text properties
TEXT_PROPERTIES = ("correlation_id", "reply_to", "message_id", "user_id", "app_id")
MAX_PRIORITY = 255  # an AMQP octet (RabbitMQ honours 0..255, Redis 0..9 of it)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_names(names: Iterable[tuple[str, Any]]) -> None:
    """Each ``(what, name)``: text of at most 255 UTF-8 bytes; ``MalformedMessageError`` naming the first that is not."""
    for what, name in names:
        if not isinstance(name, str):
            raise MalformedMessageError(f"{what} must be text, got {type(name).__name__}")
        try:
            size = len(name.encode("utf-8"))
        except UnicodeEncodeError:
            raise MalformedMessageError(f"{what} {_short(name)} is not UTF-8 text (a lone surrogate)") from None
        if size > SHORT_STR_BYTES:
            raise MalformedMessageError(f"{what} is {size} bytes, over the {SHORT_STR_BYTES} a broker name or "
                                        f"property holds: {_short(name)}")


# A message's headers travel in one AMQP frame (RabbitMQ's frame_max: 131072 bytes by default); larger, the broker
# closes the relay's connection (FRAME_ERROR) on every batch holding the row. The headers' UTF-8 JSON is held to
# half of it (the frame's own encoding of a table adds a few bytes per entry).
MAX_HEADERS_CHARS = 64 * 1024


def check_headers_size(headers: Any, *, what: str) -> None:
    """A task message's headers as UTF-8 JSON: at most ``MAX_HEADERS_CHARS`` bytes (``ValidationError``)."""
    text = json.dumps(headers, separators=(",", ":"), ensure_ascii=False, default=str)
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_HEADERS_CHARS:
        raise ValidationError(f"{what}: the message headers are {size} bytes as JSON, over the "
                              f"{MAX_HEADERS_CHARS} one broker frame holds; nothing was written")


def headers_may_be_large(headers: Mapping[str, Any]) -> bool:
    """A cheap bound (4 bytes a character of each value's text) that ``MAX_HEADERS_CHARS`` could be passed: only
    then does the relay measure a stored task's headers (``check_headers_size``), so a common one costs a loop."""
    total = 0
    for value in headers.values():
        total += 4 * (len(value) if isinstance(value, str) else len(str(value)))
        if total > MAX_HEADERS_CHARS:
            return True
    return False


# RabbitMQ's own exchange types and those of its common plugins: another type is refused by the broker for the
# whole connection (503 COMMAND_INVALID), which the relay takes for an outage
EXCHANGE_TYPES = frozenset({"direct", "topic", "fanout", "headers", "x-delayed-message", "x-consistent-hash",
                            "x-modulus-hash", "x-random", "x-recent-history", "x-jms-topic", "x-local-random"})


def check_exchange_type(exchange_type: Any) -> None:
    """A queue declaration's exchange type: one a broker knows."""
    if exchange_type not in EXCHANGE_TYPES:
        raise MalformedMessageError(f"exchange type {_short(exchange_type)} is none a broker knows "
                                    f"({', '.join(sorted(EXCHANGE_TYPES))})")


def check_properties(properties: Mapping[str, Any]) -> None:
    """The message properties of a task row (``None`` values are left out by the relay, so not judged)."""
    check_names((f"message property {k}", properties[k]) for k in TEXT_PROPERTIES if properties.get(k) is not None)
    priority = properties.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                 or not 0 <= priority <= MAX_PRIORITY):
        raise MalformedMessageError(f"priority must be an integer 0..{MAX_PRIORITY}, got {_short(priority)}")
    expiration = properties.get("expiration")
    if expiration is not None and (isinstance(expiration, bool) or not isinstance(expiration, (int, float))
                                   or not math.isfinite(expiration) or not 0 <= expiration < 2**53 / 1000):
        raise MalformedMessageError(f"expiration must be seconds >= 0, got {_short(expiration)}")
    timestamp = properties.get("timestamp")
    if timestamp is not None and (isinstance(timestamp, bool) or not isinstance(timestamp, int)
                                  or not 0 <= timestamp < 2**64):
        raise MalformedMessageError(f"timestamp must be an integer of seconds >= 0, got {_short(timestamp)}")
