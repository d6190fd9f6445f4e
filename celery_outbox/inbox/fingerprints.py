"""The fingerprint of a dead letter: which failure it is, so thousands of dead letters read as a few groups.

A group is one consumer (or task key, or the relay) failing with one exception type and one message
once the parts that differ per message are normalised away: UUIDs, hex ids, numbers, quoted text,
e-mail addresses. ``Order 42 not found`` and ``Order 97 not found`` are one group; ``KeyError`` and
``ValueError`` in the same consumer are two. The error text the library keeps is ``Class: message``
(no traceback), so no application frame takes part. The fingerprint is computed when the dead letter
is written and stored with it (indexed), so listing groups never re-reads the error texts.
"""

from __future__ import annotations

import hashlib
import re

FINGERPRINT_CHARS = 16
_MESSAGE_MAX = 240
_CLASS = re.compile(r"\A([A-Za-z_][A-Za-z0-9_.]{0,120}):\s")
_PATTERNS = (
    (re.compile(r"[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}"), "<uuid>"),
    (re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+"), "<email>"),
    (re.compile(r"'[^']{0,200}'|\"[^\"]{0,200}\""), "<str>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b|\b[0-9a-fA-F]*[0-9][0-9a-fA-F]*[a-fA-F][0-9a-fA-F]*\b(?=\W|\Z)"), "<hex>"),
    (re.compile(r"[0-9]+(?:\.[0-9]+)?"), "<n>"),
    (re.compile(r"\s+"), " "),
)


def error_class(error: str) -> str:
    """The exception type named at the start of ``Class: message`` ('' when the text names none)."""
    m = _CLASS.match(error)
    return m.group(1) if m else ""


def normalise(error: str) -> str:
    """The error's message with per-message details replaced by placeholders, first line, bounded."""
    text = error.strip().splitlines()[0] if error.strip() else ""
    m = _CLASS.match(text)
    if m:
        text = text[m.end():]
    text = text[:_MESSAGE_MAX * 4]
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text.strip()[:_MESSAGE_MAX]


def fingerprint(*, source: str, consumer: str, error: str) -> str:
    """``source`` (outbox or consumer), the consumer (task key, relay), the error's class and normalised
    message, hashed: a short stable id for the group (hex, ``FINGERPRINT_CHARS`` long)."""
    key = "\x1f".join((source, consumer, error_class(error), normalise(error)))
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:FINGERPRINT_CHARS]
