"""One delivery of a message to a consumer, decided without Celery: count, run the inbox, retry or dead-letter.

Returning ``Delivery`` with ``retry_in_s`` asks the caller (the Celery task in
``celery_outbox.celery.consumer_tasks``) to redeliver; deliveries are counted in the database
(``inbox.attempts``), so after the consumer's maximum deliveries of any kind (failures, killed
workers) the message goes to the dead-letter store and is acked: a poison message stops blocking its
queue. Malformed input (not JSON, missing fields, an unknown event type, over the size limit, nested
deeper than ``Settings.max_json_depth``, or a broker message the worker's strategy found not to be an
outbox task message at all: ``messages.MalformedDelivery``) takes the same bounded road, raw body
kept. No content can make the dead letter itself unwritable (``inbox.dead_letters.record``), and
every error text is made storable before it is written. See docs/design.md, rule 7.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import counters, tracing
from celery_outbox.clock import Clock
from celery_outbox.config.masking import mask_secrets
from celery_outbox.consumer import ConsumerSpec
from celery_outbox.db import is_disconnect, wrap_driver_errors
from celery_outbox.errors import DatabaseError, MalformedMessageError, SerializationError, UnknownEventTypeError
from celery_outbox.inbox import attempts, dead_letters
from celery_outbox.inbox.claim import CrashSite, already_seen
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import (
    TASK_ID_NAMESPACE,
    Envelope,
    MalformedDelivery,
    check_size,
    decode_json,
    encode_json,
    storable_text,
)
from celery_outbox.policy import Backoff
from celery_outbox.schema import AttemptRow, Tables
from celery_outbox.settings import Settings


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """What one delivery came to. ``retry_in_s`` is set when the message must be redelivered."""

    outcome: Outcome
    deliveries: int
    error: str | None = None
    retry_in_s: float | None = None
    # A delivery that was dead-lettered now: its dead letter (``consumer:<id>``, as 'outbox dead-letters list'
    # prints it) and group (``outbox dead-letters groups``), named in the FAILURE Flower shows.
    dead_letter: str | None = None
    group: str | None = None


def raw_text(body: Any) -> str:
    """The delivered body as text, exactly as stored in a dead letter."""
    if isinstance(body, str):
        return body
    if isinstance(body, bytes):
        return body.decode("utf-8", errors="replace")
    try:
        return encode_json(body, what="delivered body")
    except (SerializationError, RecursionError):
        try:
            return repr(body)
        except RecursionError:
            return f"<{type(body).__name__} nested too deep to show>"


def _error_text(e: BaseException) -> str:
    """``Class: message`` of an exception, storable and bounded, whatever the message holds, a URL password masked
    (an HTTP client's error quotes the URL it called, credentials and all)."""
    try:
        text = f"{e.__class__.__name__}: {e}"
    except Exception:  # a __str__ that raises
        text = f"{e.__class__.__name__}: <unprintable>"
    return storable_text(mask_secrets(text), limit=dead_letters.ERROR_MAX_CHARS)


class RawBody:
    """The delivered body as raw text, encoded only when asked for.

    A worker's task receives JSON text, which is its own raw form; a body given as a dict (eager
    calls, idempotent tasks) is encoded once, for the size check or a dead letter, never twice.
    """

    def __init__(self, body: Any, malformed: MalformedDelivery | None) -> None:
        self._body = body
        self._value: str | bytes | None = malformed.body if malformed is not None else (
            body if isinstance(body, (str, bytes)) else None)

    @property
    def value(self) -> str | bytes:
        """What a dead letter stores as the body (``raw_text`` of a body that is not text yet)."""
        if self._value is None:
            self._value = raw_text(self._body)
        return self._value

    @property
    def text(self) -> str:
        raw = self.value
        return raw if isinstance(raw, str) else raw.decode("utf-8", "backslashreplace")


def delivery_key(body: Any, request_id: str | None, raw: str | RawBody) -> uuid.UUID:
    """The envelope's message_id when it has one; else the task id; else a hash of the raw body."""
    if isinstance(body, Mapping):
        try:
            return uuid.UUID(str(body.get("message_id"))[:100])
        except (ValueError, RecursionError):
            pass
    if request_id:
        try:
            return uuid.UUID(str(request_id))
        except ValueError:
            pass
    if isinstance(raw, RawBody):
        raw = raw.text
    try:
        return uuid.uuid5(TASK_ID_NAMESPACE, raw)
    except UnicodeEncodeError:  # lone surrogates: hash their exact code units instead
        return uuid.uuid5(TASK_ID_NAMESPACE, "surrogates:" + raw.encode("utf-8", "surrogatepass").hex())


@dataclass(frozen=True, kw_only=True)
class DeliveryContext:
    """What every delivery to one consumer shares, built once per consumer and passed down to each delivery.

    ``policy``: the consumer's backoff, resolved once (``build`` resolves ``spec.policy`` when not given).
    ``wrapper_levels``: how deep an idempotent task's envelope nests its arguments (celery/idempotent_task.py),
    so an argument is held to the depth bound on its own, as ``delay()`` and the worker's gate hold it
    (celery_outbox/task_rules.py). ``destination`` and ``park_timeout_ms`` are derived from the rest.
    """

    spec: ConsumerSpec
    tables: Tables
    settings: Settings
    clock: Clock
    policy: Backoff
    crash_points: CrashSite | None = None
    wrapper_levels: int = 0
    destination: str = field(init=False)
    park_timeout_ms: int | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "destination", self.settings.queue_name(self.spec.name))
        object.__setattr__(self, "park_timeout_ms", self.settings.consumer_park_timeout_ms if self.spec.ordering else None)

    @classmethod
    def build(cls, spec: ConsumerSpec, *, tables: Tables, settings: Settings, clock: Clock,
              crash_points: CrashSite | None = None, policy: Backoff | None = None,
              wrapper_levels: int = 0) -> DeliveryContext:
        return cls(spec=spec, tables=tables, settings=settings, clock=clock, crash_points=crash_points,
                   policy=policy if policy is not None else spec.policy.resolve(settings),
                   wrapper_levels=wrapper_levels)


@dataclass(frozen=True, kw_only=True)
class Body:
    """A delivered body, parsed once (``parse_body``): every step of the delivery reads this object.

    ``mapping``: the body as an object (None when it is not one: not JSON, not an object, or
    ``malformed``); ``type`` and ``headers``: what it names, as far as it names them (kept with a
    dead letter, made storable there); ``raw``: the body as a dead letter stores it.
    """

    value: Any
    malformed: MalformedDelivery | None
    mapping: Mapping[str, Any] | None
    raw: RawBody
    type: str | None
    headers: Mapping[str, Any]

    def ids(self) -> tuple[str, str | None]:
        """The (message_id, event type) the body names, as far as it names them (storable, bounded)."""
        mapping = self.mapping
        raw_id = mapping.get("message_id") if mapping is not None else None
        message_id = storable_text(raw_id, limit=64) if isinstance(raw_id, str) else ""
        return message_id, storable_text(self.type, limit=200) if self.type is not None else None


def parse_body(body: Any, *, max_depth: int) -> Body:
    """Parse a delivered body once: a malformed delivery (``messages.MalformedDelivery``), JSON text, or a mapping.

    A ``Body`` is returned as it is, so a caller that parsed it already passes it down unchanged."""
    if isinstance(body, Body):
        return body
    malformed = MalformedDelivery.decode(body) if isinstance(body, str) else None
    mapping = _as_mapping(body, malformed, max_depth)
    btype, bheaders = _body_meta(mapping)
    if malformed is not None:
        bheaders = {"broker_headers": malformed.headers, "content_type": malformed.content_type,
                    "content_encoding": malformed.content_encoding}
    return Body(value=body, malformed=malformed, mapping=mapping, raw=RawBody(body, malformed), type=btype,
                headers=bheaders)


def parse_envelope(context: DeliveryContext, body: Body, gated: bool) -> Envelope:
    """Validate the parsed body as an envelope this consumer accepts (``MalformedMessageError``,
    ``UnknownEventTypeError``, ``MessageTooLargeError`` when it is not one). Also used by ``batch_delivery``
    to sort a batch's messages into those it can batch and those that go alone."""
    spec, settings, mapping = context.spec, context.settings, body.mapping
    if body.malformed is not None:
        raise MalformedMessageError(body.malformed.error)
    if not gated:  # a gated body's size was checked on its raw bytes (``deliver``); encoding it again costs a dump
        check_size(body.raw.value, limit=settings.max_message_bytes, what=f"message for {spec.name}")
    # The body was decoded once already (``_as_mapping``, a depth bound as tight or tighter): validate that
    # value, do not decode or walk it again. A body that came as a mapping was never measured: it is walked.
    decoded = mapping is not None and mapping is not body.value
    envelope = Envelope.from_dict(mapping if mapping is not None else body.value,
                                  max_depth=settings.max_json_depth + context.wrapper_levels,
                                  decoded_within=settings.max_json_depth if decoded else None)
    if not spec.accepts(envelope.type):
        raise UnknownEventTypeError(
            f"consumer {spec.name!r} does not handle event type {storable_text(repr(envelope.type), limit=220)} "
            f"(it handles: {', '.join(sorted(spec.events))})"
        )
    return envelope


def _as_mapping(body: Any, malformed: MalformedDelivery | None, max_depth: int) -> Mapping[str, Any] | None:
    """The body as an object, for its message_id, type and headers (None when it is not one)."""
    if malformed is not None:
        return None
    if isinstance(body, Mapping):
        return body
    if isinstance(body, (str, bytes)):
        try:
            decoded = decode_json(body, max_depth=max_depth)
        except MalformedMessageError:
            return None
        return decoded if isinstance(decoded, Mapping) else None
    return None


def deliver(sessions: sessionmaker[Session], spec: ConsumerSpec, body: Any, *, tables: Tables, request_id: str | None,
            settings: Settings, clock: Clock, crash_points: CrashSite | None = None,
            first_delivery: bool = False, redelivered: bool = False, policy: Backoff | None = None,
            gated: bool = False, wrapper_levels: int = 0) -> Delivery:
    """One delivery of ``body`` for ``spec``, its ``DeliveryContext`` built for it (``deliver_with``).

    A caller that delivers many messages to one consumer (the consumer tasks) builds the context once
    and calls ``deliver_with``; ``policy``: ``spec.policy`` already resolved."""
    context = DeliveryContext.build(spec, tables=tables, settings=settings, clock=clock, crash_points=crash_points,
                                    policy=policy, wrapper_levels=wrapper_levels)
    return deliver_with(context, sessions, body, request_id=request_id, first_delivery=first_delivery,
                        redelivered=redelivered, gated=gated)


def deliver_with(context: DeliveryContext, sessions: sessionmaker[Session], body: Any, *, request_id: str | None,
                 first_delivery: bool = False, redelivered: bool = False, gated: bool = False) -> Delivery:
    """Handle one delivery of ``body`` (as delivered, or the ``Body`` ``parse_body`` made of it) for the
    context's consumer: count it, run the inbox, decide retry/dead letter.

    ``first_delivery`` (no retry so far, no broker redelivery) takes the fast path: nothing is
    counted up front and the happy path costs the effect's one commit; the delivery is counted if it
    fails, and if its worker dies instead the redelivery arrives ``redelivered`` and is counted for
    both. Any other delivery is counted at its start, which bounds a message that kills its worker.

    ``gated``: the raw message already passed the worker's gate in this worker (size and depth), so its
    size is not checked again by encoding the envelope.
    """
    parsed = parse_body(body, max_depth=context.settings.max_json_depth)
    key = delivery_key(parsed.mapping if parsed.mapping is not None else parsed.value, request_id, parsed.raw)
    # The delivery's span continues the trace the envelope carries (a no-op without OpenTelemetry).
    with tracing.consuming(consumer=context.spec.name, destination=context.destination, message_id=str(key),
                           event_type=parsed.type, headers=parsed.headers if parsed.malformed is None else {}) as span:
        try:
            result = _deliver(context, sessions, parsed, key, first_delivery=first_delivery, redelivered=redelivered,
                              gated=gated, reconnect=True, task_id=request_id)
        except _Reconnect:  # the pooled connection was dead (db.pre_ping_after_idle): once more on a new one
            result = _deliver(context, sessions, parsed, key, first_delivery=first_delivery, redelivered=redelivered,
                              gated=gated, reconnect=False, task_id=request_id)
        span.record(result.outcome.value, deliveries=result.deliveries, error=result.error,
                    failed=result.outcome in (Outcome.RETRY, Outcome.DEAD_LETTERED))
    return result


class _Reconnect(Exception):
    """Internal: this delivery lost its connection before it committed or counted anything."""


def _deliver(context: DeliveryContext, sessions: sessionmaker[Session], body: Body, key: uuid.UUID, *,
             first_delivery: bool, redelivered: bool, gated: bool, reconnect: bool,
             task_id: str | None = None) -> Delivery:
    """``reconnect``: a first delivery whose connection was lost (the engine pings only connections idle
    longer than ``Settings.db_pre_ping_idle_ms``, db.py) raises ``_Reconnect`` before anything is
    counted: the caller runs it once more, on a new connection. Its transaction died with the
    connection, or committed if the loss hit the commit's answer (then the inbox reports the duplicate).
    The second time it is a failure like any other, so a message that breaks its connection every time
    is still counted. A count that loses its connection (``attempts.begin``: its commit may have
    landed) is a redelivery, uncounted, as when the database is down."""
    spec, tables, clock, policy = context.spec, context.tables, context.clock, context.policy
    name, limit = spec.name, policy.max_deliveries
    try:
        connection = _connect(sessions)
    except DatabaseError as e:  # the database is down: redeliver, do not count (as ``count`` below)
        return Delivery(outcome=Outcome.RETRY, deliveries=0, error=_error_text(e), retry_in_s=policy.delay_s(1))
    with connection if connection is not None else nullcontext(), \
            sessions() if connection is None else sessions(bind=connection) as session:

        def count() -> AttemptRow | Delivery:
            try:
                return attempts.begin(session, tables=tables, key=key, consumer=name, now_ms=clock.now_ms(),
                                      uncounted=1 if redelivered else 0)
            except DatabaseError as e:
                # The database is down: nobody's fault but the system's; redeliver, do not count.
                return Delivery(outcome=Outcome.RETRY, deliveries=0, error=_error_text(e),
                                retry_in_s=policy.delay_s(1))

        row: AttemptRow | None = None
        if redelivered or not first_delivery:
            counted = count()
            if isinstance(counted, Delivery):
                return counted
            row = counted
            if row.deliveries > limit:
                return _worker_lost(session, row, context=context, body=body, task_id=task_id)
        try:
            envelope = parse_envelope(context, body, gated)
            # An ordered consumer's delivery also dead-letters parked messages past the timeout (inbox/handle.py).
            outcome = spec.handle(session, envelope, tables=tables, clock=clock, crash_points=context.crash_points,
                                  park_timeout_ms=context.park_timeout_ms)
        except Exception as e:
            session.rollback()
            if reconnect and row is None and is_disconnect(e):  # nothing counted, nothing committed
                raise _Reconnect from e
            error = _error_text(e)
            if row is None:  # a first delivery is counted only now that it failed
                counted = count()
                if isinstance(counted, Delivery):
                    return counted
                row = counted
                if row.deliveries > limit:  # a dead-lettered copy came back
                    return _worker_lost(session, row, context=context, body=body, task_id=task_id)
            return _failed(session, row, context=context, body=body, error=error, task_id=task_id,
                           retry_in_s=policy.delay_s(row.deliveries))
        if row is None:  # a first delivery that went through: nothing was counted, nothing to clear
            return Delivery(outcome=outcome, deliveries=1)
        deliveries = row.deliveries  # read before ``forget`` deletes the row under it
        try:
            attempts.forget(session, tables=tables, key=key, consumer=name)
        except DatabaseError:
            session.rollback()  # bookkeeping only; the effect is committed and the message must be acked
        return Delivery(outcome=outcome, deliveries=deliveries)


def _connect(sessions: sessionmaker[Session]) -> sa.Connection | None:
    """ONE pooled connection for the whole delivery (None when ``sessions`` is not bound to an engine).

    A delivery may run several short transactions (a ``prepare`` step's read and the external
    call's own, the delivery count, the inbox transaction); a session bound to the engine returns
    its connection to the pool after each, and every checkout costs a round trip when the engine
    pre-pings (``db.make_engine``). Raises ``DatabaseError`` when no connection can be had.
    """
    bind = sessions.kw.get("bind")
    if not isinstance(bind, sa.Engine):
        return None
    with wrap_driver_errors("connecting for a delivery"):
        return bind.connect()


def _body_meta(body: Mapping[str, Any] | None) -> tuple[str | None, Mapping[str, Any]]:
    """The type and headers of a body, as far as it has them (kept with a dead letter, made storable there)."""
    if body is None:
        return None, {}
    btype = body.get("type") if isinstance(body.get("type"), str) else None
    headers = body["headers"] if isinstance(body.get("headers"), Mapping) else {}
    return btype, headers


def _failed(session: Session, row: AttemptRow, *, context: DeliveryContext, body: Body, error: str,
            retry_in_s: float, task_id: str | None = None) -> Delivery:
    tables, spec, limit = context.tables, context.spec, context.policy.max_deliveries
    now = context.clock.now_ms()
    try:
        attempts.fail(session, row, error=error, now_ms=now)
        if row.deliveries >= limit:
            dead = dead_letters.record(
                session, tables=tables, consumer=spec.name, message_id=str(row.message_id), type=body.type,
                body=body.raw.value, headers=body.headers, delivery_count=row.deliveries, last_error=error,
                first_failed_at_ms=row.first_failed_at_ms, last_failed_at_ms=now, task_id=task_id,
            )
            session.commit()
            return Delivery(outcome=Outcome.DEAD_LETTERED, deliveries=row.deliveries, error=error,
                            dead_letter=f"consumer:{dead.id}", group=dead.fingerprint)
        session.commit()
    except Exception as e:  # the failure could not even be recorded: redeliver, counted at the next begin
        session.rollback()
        return Delivery(outcome=Outcome.RETRY, deliveries=row.deliveries,
                        error=storable_text(f"{error} (and {_error_text(e)})", limit=dead_letters.ERROR_MAX_CHARS),
                        retry_in_s=retry_in_s)
    return Delivery(outcome=Outcome.RETRY, deliveries=row.deliveries, error=error, retry_in_s=retry_in_s)


def _worker_lost(session: Session, row: AttemptRow, *, context: DeliveryContext, body: Body,
                 task_id: str | None = None) -> Delivery:
    """More deliveries than allowed: earlier ones died without recording an outcome (killed worker),
    or this message is already dead-lettered and came back (a crash before the ack), or it was
    processed and the worker died between the inbox commit and the ack."""
    tables, spec, limit = context.tables, context.spec, context.policy.max_deliveries
    if already_seen(session, row.message_id, spec.name, tables=tables):
        session.rollback()
        counters.increment(session, spec.name, counters.DUPLICATES, tables=tables)
        attempts.forget(session, tables=tables, key=row.message_id, consumer=spec.name)
        return Delivery(outcome=Outcome.DUPLICATE, deliveries=row.deliveries)
    if dead_letters.is_open(session, tables=tables, consumer=spec.name, message_id=str(row.message_id)):
        session.rollback()
        return Delivery(outcome=Outcome.DEAD_LETTERED, deliveries=row.deliveries - 1,
                        error="already in the dead-letter store")
    error = storable_text(f"delivered {row.deliveries - 1} times (max {limit}) without an outcome: the worker was lost "
                          f"(killed or crashed) during the delivery; last recorded error: {row.last_error or 'none'}",
                          limit=dead_letters.ERROR_MAX_CHARS)
    now = context.clock.now_ms()
    dead = dead_letters.record(
        session, tables=tables, consumer=spec.name, message_id=str(row.message_id), type=body.type,
        body=body.raw.value, headers=body.headers, delivery_count=row.deliveries - 1, last_error=error,
        first_failed_at_ms=row.first_failed_at_ms, last_failed_at_ms=now, task_id=task_id,
    )
    attempts.fail(session, row, error=error, now_ms=now)
    session.commit()
    return Delivery(outcome=Outcome.DEAD_LETTERED, deliveries=row.deliveries - 1, error=error,
                    dead_letter=f"consumer:{dead.id}", group=dead.fingerprint)
