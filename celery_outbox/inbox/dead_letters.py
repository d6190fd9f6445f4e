"""The consumer dead-letter store: what a consumer gave up on, for a person to list, inspect,
replay or purge.

The raw body text is kept, so even a message that was never valid JSON is not lost. Replay sends the
stored envelope back to its consumer's queue; the inbox still guards it (rule 8), so replaying a
message that did get processed after all is a harmless DUPLICATE.

Writing a dead letter must never fail on its content, or the poison it records would be redelivered
for ever. So ``record`` stores everything in a form both SQLite and Postgres accept:

* ``body``: the raw text as-is when it is text the database can hold (UTF-8, no NUL, no lone
  surrogate); anything else (raw bytes, NUL, surrogates, or a text that happens to start with the
  marker) as ``BODY_B64_PREFIX`` + base64 of its exact bytes. ``body_of`` gives the original back.
* ``type``, ``message_id``, ``last_error``: NUL and surrogates escaped, cut to the column width.
* ``headers``: a JSON object of storable strings, numbers, booleans and nulls, at most
  ``HEADERS_MAX_DEPTH`` deep and ``HEADERS_MAX_CHARS`` encoded; what does not fit is summarised.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox import counters
from celery_outbox.clock import Clock
from celery_outbox.config.masking import mask_secrets
from celery_outbox.db import wrap_driver_errors
from celery_outbox.errors import MalformedMessageError, NotFoundError, ValidationError
from celery_outbox.inbox.fingerprints import fingerprint
from celery_outbox.inbox.task_keys import is_task_key
from celery_outbox.messages import (
    DEFAULT_MAX_JSON_DEPTH,
    TYPE_MAX_CHARS,
    Envelope,
    decode_json,
    is_storable,
    storable_text,
)
from celery_outbox.schema import DeadLetterRow, Tables

Send = Callable[[str, dict[str, Any]], None]
"""``send(consumer, envelope_dict)``: enqueue the envelope on that consumer's queue."""


BODY_B64_PREFIX = "outbox-b64:"
ERROR_MAX_CHARS = 8000
HEADERS_MAX_DEPTH = 8
HEADERS_MAX_CHARS = 16_000
_HEADER_KEYS_MAX = 200
_HEADER_TEXT_MAX = 2000


def storable_body(body: str | bytes) -> str:
    """The body as the ``body`` column stores it (see the module docstring); ``body_of`` reverses it."""
    if isinstance(body, str):
        if is_storable(body) and not body.startswith(BODY_B64_PREFIX):
            return body
        raw = body.encode("utf-8", "surrogatepass")
    else:
        raw = bytes(body)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is not None and is_storable(text) and not text.startswith(BODY_B64_PREFIX):
            return text
    return BODY_B64_PREFIX + base64.b64encode(raw).decode("ascii")


def body_bytes(row_body: str) -> bytes:
    """The exact bytes of a stored body (undoing ``storable_body``)."""
    if row_body.startswith(BODY_B64_PREFIX):
        try:
            return base64.b64decode(row_body[len(BODY_B64_PREFIX):], validate=True)
        except (ValueError, binascii.Error):
            pass
    return row_body.encode("utf-8", "surrogatepass")


def body_of(row_body: str) -> str:
    """The stored body as text (undoing ``storable_body``): the original string, lone surrogates
    included; bytes that were not UTF-8 come back with surrogate escapes."""
    if not row_body.startswith(BODY_B64_PREFIX):
        return row_body
    raw = body_bytes(row_body)
    for errors in ("strict", "surrogatepass"):
        try:
            return raw.decode("utf-8", errors)
        except UnicodeDecodeError:
            continue
    return raw.decode("utf-8", "surrogateescape")


def storable_headers(headers: Any) -> dict[str, Any]:
    """``headers`` reduced to a JSON object any database stores (never raises; see module docstring)."""
    if not isinstance(headers, Mapping):
        return {} if headers is None else {"_unreadable": storable_text(repr(type(headers).__name__), limit=200)}
    clean = _clean_value(headers, 1)
    try:
        encoded = json.dumps(clean, allow_nan=False)
    except (TypeError, ValueError):  # pragma: no cover - _clean_value only yields JSON
        return {"_unreadable": "headers could not be encoded"}
    if len(encoded) > HEADERS_MAX_CHARS:
        return {"_truncated": storable_text(encoded, limit=HEADERS_MAX_CHARS // 2)}
    return clean if isinstance(clean, dict) else {}


def _clean_value(value: Any, depth: int) -> Any:
    """One header value made storable. Iterates at most ``HEADERS_MAX_DEPTH`` levels (bounded)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**63 else str(value)[:40]
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return storable_text(value, limit=_HEADER_TEXT_MAX)
    if isinstance(value, (bytes, bytearray)):
        return storable_text(bytes(value)[:_HEADER_TEXT_MAX].decode("utf-8", "backslashreplace"), limit=_HEADER_TEXT_MAX)
    if isinstance(value, (Mapping, list, tuple)):
        if depth >= HEADERS_MAX_DEPTH:
            return f"<{type(value).__name__} nested deeper than {HEADERS_MAX_DEPTH}>"
        if isinstance(value, Mapping):
            items = list(value.items())[:_HEADER_KEYS_MAX]
            return {storable_text(str(k) if isinstance(k, (str, int, float, bool)) or k is None else repr(type(k)),
                                  limit=200): _clean_value(v, depth + 1) for k, v in items}
        return [_clean_value(v, depth + 1) for v in list(value)[:_HEADER_KEYS_MAX]]
    return storable_text(f"<{type(value).__name__}>", limit=200)


def record(session: Session, *, tables: Tables, consumer: str, message_id: str, type: str | None, body: str | bytes,
           headers: Any, delivery_count: int, last_error: str, first_failed_at_ms: int,
           last_failed_at_ms: int, task_id: str | None = None) -> DeadLetterRow:
    """Stage a dead letter in ``session`` (the caller commits, together with whatever gave up).

    Every text is made storable first (module docstring), so this fails only when the database does.
    ``task_id``: the Celery task id of the delivery that gave up; a replay runs under it (``replay``).
    One that is not storable as it is (too long, not text) is not kept: a cut id would name another task.
    """
    type_ = storable_text(type, limit=TYPE_MAX_CHARS) if isinstance(type, str) and type else None
    consumer = storable_text(consumer, limit=64)
    # masked before it is kept: every reader (the CLI, the admin pages, Flower's events, trace) shows it as stored
    last_error = storable_text(mask_secrets(str(last_error)), limit=ERROR_MAX_CHARS)
    row = tables.dead_letters(
        consumer=consumer, message_id=storable_text(str(message_id), limit=64), type=type_,
        body=storable_body(body), headers=storable_headers(headers), delivery_count=delivery_count,
        last_error=last_error, first_failed_at_ms=first_failed_at_ms, last_failed_at_ms=last_failed_at_ms,
        replayed_at_ms=None, fingerprint=fingerprint(source="consumer", consumer=consumer, error=last_error),
        task_id=task_id if isinstance(task_id, str) and 0 < len(task_id) <= 64 and is_storable(task_id) else None,
    )
    session.add(row)
    session.flush()
    counters.stage_increment(session, consumer, counters.DEAD_LETTERED, tables=tables)
    return row


def check_consumer(consumer: str, known_consumers: Iterable[str] | None) -> None:
    if known_consumers is None:
        return
    known = list(known_consumers)
    if consumer not in known:
        raise NotFoundError(f"unknown consumer {consumer!r}; configured consumers: {', '.join(known) or '(none)'}")


def list_dead_letters(session: Session, *, tables: Tables, consumer: str | None = None, include_replayed: bool = False,
                      known_consumers: Iterable[str] | None = None) -> list[DeadLetterRow]:
    """Dead letters, oldest first; by default only those not replayed yet."""
    if consumer is not None:
        check_consumer(consumer, known_consumers)
    stmt = sa.select(tables.dead_letters).order_by(tables.dead_letters.id)
    if consumer is not None:
        stmt = stmt.where(tables.dead_letters.consumer == consumer)
    if not include_replayed:
        stmt = stmt.where(tables.dead_letters.replayed_at_ms.is_(None))
    with wrap_driver_errors("listing consumer dead letters"):
        return list(session.execute(stmt).scalars().all())


def get(session: Session, id: int, *, tables: Tables) -> DeadLetterRow:
    with wrap_driver_errors(f"reading dead letter {id}"):
        row = session.get(tables.dead_letters, id)
    if row is None:
        raise NotFoundError(f"no consumer dead letter with id {id}")
    return row


def is_open(session: Session, *, tables: Tables, consumer: str, message_id: str) -> bool:
    """True when an unreplayed dead letter for (consumer, message_id) exists."""
    stmt = sa.select(sa.literal(1)).where(
        tables.dead_letters.consumer == consumer, tables.dead_letters.message_id == message_id[:64],
        tables.dead_letters.replayed_at_ms.is_(None),
    )
    return session.execute(stmt).first() is not None


def envelope_of(row: DeadLetterRow, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> dict[str, Any]:
    """The stored body as the dict to send again; a body that never was an envelope (not an object, an object
    the consumers' own check refuses, or nested deeper than ``max_depth``) cannot be replayed: sent again, it
    would only come back to the dead letters."""
    try:
        body = decode_json(body_of(row.body), max_depth=max_depth, what=f"dead letter {row.id}")
    except MalformedMessageError:
        body = None
    if isinstance(body, list) and is_task_key(row.consumer):
        body = _task_call(row, body)
    if not isinstance(body, dict):
        raise ValidationError(
            f"dead letter {row.id} ({row.consumer}) is not an envelope object, so it cannot be replayed "
            f"as-is; inspect its body and purge it"
        )
    try:
        Envelope.from_dict(body, max_depth=max_depth)
    except MalformedMessageError as e:
        raise ValidationError(
            f"dead letter {row.id} ({row.consumer}) is not a valid envelope ({storable_text(str(e), limit=200)}), "
            f"so it cannot be replayed as-is; inspect its body and purge it"
        ) from None
    return body


def _task_call(row: DeadLetterRow, body: list[Any]) -> dict[str, Any] | None:
    """A task message the worker's gate dead-letters keeps its raw protocol-2 body ``[args, kwargs,
    embed]`` (celery_outbox/celery/gate.py): as the task call ``idempotent_task.envelope_for`` builds,
    so replay re-sends it as that task with its task id (the embed is not re-sent)."""
    if not (len(body) == 3 and isinstance(body[0], list) and isinstance(body[1], dict) and row.type):
        return None
    return {"message_id": row.message_id, "type": row.type, "payload": {"args": body[0], "kwargs": body[1]},
            "headers": {"outbox_kind": "task", "task": row.type, "task_id": row.message_id}, "created_at_ms": 0}


def _forget_attempts(session: Session, *, tables: Tables, consumer: str, message_id: str) -> None:
    try:
        key = uuid.UUID(message_id)
    except ValueError:
        return
    session.execute(sa.delete(tables.attempts).where(tables.attempts.message_id == key,
                                                     tables.attempts.consumer == consumer))


def replay(session: Session, id: int, *, tables: Tables, send: Send, clock: Clock,
           known_consumers: Iterable[str] | None = None, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> DeadLetterRow:
    """Send dead letter ``id`` back to its consumer and mark it replayed; commits.

    The delivery count starts afresh (the replayed message gets the full number of deliveries).
    Order: forget the count, send, then mark; a crash after the send costs at most a second replay,
    which the inbox absorbs.

    A consumer's dead letter that kept its task id goes out under that id when ``send`` can send
    under one (``send.send_as(consumer, envelope, task_id=...)``, as ``celery.sender.ReplaySender``
    does): Flower then shows that task go from FAILURE to the replay's outcome. The inbox is keyed by
    the envelope's message_id, not the task id, so this changes nothing of what runs: the replay is
    processed once, or absorbed as a duplicate if the message was processed after all.
    """
    row = get(session, id, tables=tables)
    check_consumer(row.consumer, known_consumers)
    envelope = envelope_of(row, max_depth=max_depth)
    with wrap_driver_errors(f"replaying dead letter {id}"):
        _forget_attempts(session, tables=tables, consumer=row.consumer, message_id=row.message_id)
        session.commit()
    send_replay(send, row, envelope)
    with wrap_driver_errors(f"marking dead letter {id} replayed"):
        row.replayed_at_ms = clock.now_ms()
        session.commit()
    return row


def send_replay(send: Send, row: DeadLetterRow, envelope: dict[str, Any]) -> bool:
    """Send ``row``'s envelope back (every replay path: one, ``--all``, a group); True when it went out under
    the dead-lettered delivery's task id (``replay``), False when as a new task."""
    send_as = getattr(send, "send_as", None)
    if row.task_id and callable(send_as):
        send_as(row.consumer, envelope, task_id=row.task_id)
        return True
    send(row.consumer, envelope)
    return False


def purge(session: Session, ids: Sequence[int], *, tables: Tables) -> int:
    """Delete these dead letters (all or none: an unknown id changes nothing); commits; returns the count."""
    wanted = sorted(set(ids))
    if not wanted:
        return 0
    with wrap_driver_errors("purging consumer dead letters"):
        rows = session.execute(sa.select(tables.dead_letters).where(tables.dead_letters.id.in_(wanted))).scalars().all()
        missing = sorted(set(wanted) - {r.id for r in rows})
        if missing:
            session.rollback()
            raise NotFoundError(f"no consumer dead letter with id(s) {', '.join(map(str, missing))}; nothing purged")
        for row in rows:
            _forget_attempts(session, tables=tables, consumer=row.consumer, message_id=row.message_id)
            session.delete(row)
        session.commit()
    return len(rows)
