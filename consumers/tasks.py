"""Celery integration: one task ``consumers.<name>`` per consumer, on its own queue.

Returning acks the message (acks_late: only after the inbox commit). Raising is turned into
``self.retry`` with exponential backoff; deliveries are counted in the database (``attempts``), so
after ``consumer_max_deliveries`` deliveries of any kind (failures, killed workers) the message goes
to the dead-letter store and is acked: a poison message stops blocking its queue. Malformed input
(not JSON, missing fields, an unknown event type, over the size limit) takes the same bounded road,
raw body kept. ``deliver()`` is the whole decision as a plain function; the task only maps its
result onto Celery.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from celeryconfig import Settings, add_task_routes
from consumers import attempts, dead_letters, ordering
from consumers.decorator import ConsumerRegistry, ConsumerSpec, default_registry
from consumers.inbox import DUPLICATES, CrashSite, already_seen, increment_counter
from consumers.models import DeliveryAttempt
from consumers.outcome import Outcome
from outbox import events
from outbox.clock import Clock, SystemClock
from outbox.crashpoints import CrashPoints
from outbox.db import make_engine, make_session_factory
from outbox.errors import DatabaseError, SerializationError, UnknownEventTypeError
from outbox.messages import TASK_ID_NAMESPACE, Envelope, check_size, encode_json, task_name


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """What one delivery came to. ``retry_in_s`` is set when the message must be redelivered."""

    outcome: Outcome
    deliveries: int
    error: str | None = None
    retry_in_s: float | None = None


def _announce(app: Any, consumer: str, body: Any, result: Delivery) -> None:
    """Custom Celery events for the two outcomes an operator watches in Flower (best effort)."""
    if result.outcome not in (Outcome.DUPLICATE, Outcome.DEAD_LETTERED):
        return
    raw = body.get("message_id") if isinstance(body, Mapping) else None
    message_id = str(raw) if raw is not None else ""
    event_type = body.get("type") if isinstance(body, Mapping) else None
    if result.outcome is Outcome.DUPLICATE:
        events.duplicate_absorbed(app, consumer=consumer, message_id=message_id, event_type=event_type)
    else:
        events.dead_lettered(app, source="consumer", consumer=consumer, message_id=message_id,
                             error=result.error or "", event_type=event_type, attempts=result.deliveries)


class SessionSource:
    """One engine per worker process, created lazily after the fork (never shared across processes)."""

    def __init__(self, *, url: str) -> None:
        self._url = url
        self._pid: int | None = None
        self._factory: sessionmaker[Session] | None = None
        self._lock = threading.Lock()

    def __call__(self) -> sessionmaker[Session]:
        pid = os.getpid()
        factory = self._factory
        if factory is not None and self._pid == pid:
            return factory
        with self._lock:
            if self._factory is None or self._pid != pid:
                if self._factory is not None:
                    bind = self._factory.kw.get("bind")
                    if bind is not None:
                        bind.dispose(close=False)  # the parent's pool: forget it, never close its sockets
                self._factory = make_session_factory(make_engine(self._url))
                self._pid = pid
            return self._factory


def backoff_s(deliveries: int, *, base_s: float, max_s: float) -> float:
    return float(min(max_s, base_s * 2 ** max(0, deliveries - 1)))


def raw_text(body: Any) -> str:
    """The delivered body as text, exactly as stored in a dead letter."""
    if isinstance(body, str):
        return body
    if isinstance(body, bytes):
        return body.decode("utf-8", errors="replace")
    try:
        return encode_json(body, what="delivered body")
    except SerializationError:
        return repr(body)


def delivery_key(body: Any, request_id: str | None, raw: str) -> uuid.UUID:
    """The envelope's message_id when it has one; else the task id; else a hash of the raw body."""
    if isinstance(body, Mapping):
        try:
            return uuid.UUID(str(body.get("message_id")))
        except ValueError:
            pass
    if request_id:
        try:
            return uuid.UUID(str(request_id))
        except ValueError:
            pass
    return uuid.uuid5(TASK_ID_NAMESPACE, raw)


def _parse(spec: ConsumerSpec, body: Any, raw: str, max_bytes: int) -> Envelope:
    check_size(raw, limit=max_bytes, what=f"message for {spec.name}")
    envelope = Envelope.from_dict(body)
    if not spec.accepts(envelope.type):
        raise UnknownEventTypeError(
            f"consumer {spec.name!r} does not handle event type {envelope.type!r} "
            f"(it handles: {', '.join(sorted(spec.events))})"
        )
    return envelope


def deliver(sessions: sessionmaker[Session], spec: ConsumerSpec, body: Any, *, request_id: str | None,
            settings: Settings, clock: Clock, crash_points: CrashSite | None = None,
            first_delivery: bool = False, redelivered: bool = False) -> Delivery:
    """Handle one delivery of ``body`` for ``spec``: count it, run the inbox, decide retry/dead letter.

    ``first_delivery`` (no retry so far, no broker redelivery) takes the fast path: nothing is
    counted up front and the happy path costs the effect's one commit; the delivery is counted if it
    fails, and if its worker dies instead the redelivery arrives ``redelivered`` and is counted for
    both. Any other delivery is counted at its start, which bounds a message that kills its worker.
    """
    raw = raw_text(body)
    key = delivery_key(body, request_id, raw)
    name, limit = spec.name, settings.consumer_max_deliveries
    retry_base, retry_max = settings.consumer_retry_backoff_s, settings.consumer_retry_backoff_max_s
    btype, bheaders = _body_meta(body)
    with sessions() as session:

        def count() -> DeliveryAttempt | Delivery:
            try:
                return attempts.begin(session, key=key, consumer=name, now_ms=clock.now_ms(),
                                      uncounted=1 if redelivered else 0)
            except DatabaseError as e:
                # The database is down: nobody's fault but the system's; redeliver, do not count.
                return Delivery(outcome=Outcome.RETRY, deliveries=0, error=str(e),
                                retry_in_s=backoff_s(1, base_s=retry_base, max_s=retry_max))

        row: DeliveryAttempt | None = None
        if redelivered or not first_delivery:
            counted = count()
            if isinstance(counted, Delivery):
                return counted
            row = counted
            if row.deliveries > limit:
                return _worker_lost(session, row, spec=spec, raw=raw, type_=btype, headers=bheaders, clock=clock,
                                    limit=limit)
        try:
            envelope = _parse(spec, body, raw, settings.max_message_bytes)
            outcome = spec.handle(session, envelope, clock=clock, crash_points=crash_points)
        except Exception as e:
            session.rollback()
            error = f"{e.__class__.__name__}: {e}"
            if row is None:  # a first delivery is counted only now that it failed
                counted = count()
                if isinstance(counted, Delivery):
                    return counted
                row = counted
                if row.deliveries > limit:  # a dead-lettered copy came back
                    return _worker_lost(session, row, spec=spec, raw=raw, type_=btype, headers=bheaders,
                                        clock=clock, limit=limit)
            return _failed(session, row, spec=spec, raw=raw, type_=btype, headers=bheaders, error=error,
                           clock=clock, limit=limit,
                           retry_in_s=backoff_s(row.deliveries, base_s=retry_base, max_s=retry_max))
        deliveries = row.deliveries if row is not None else 1
        try:
            if row is not None:
                attempts.forget(session, key=key, consumer=name)
            if spec.ordering:
                ordering.expire_parked(session, consumer=name, now_ms=clock.now_ms(),
                                       timeout_ms=settings.consumer_park_timeout_ms)
        except DatabaseError:
            session.rollback()  # bookkeeping only; the effect is committed and the message must be acked
        return Delivery(outcome=outcome, deliveries=deliveries)


def _body_meta(body: Any) -> tuple[str | None, Mapping[str, Any]]:
    """The type and headers of a body, as far as it has them (kept with a dead letter)."""
    if not isinstance(body, Mapping):
        return None, {}
    btype = body.get("type") if isinstance(body.get("type"), str) else None
    headers = body["headers"] if isinstance(body.get("headers"), Mapping) else {}
    return btype, headers


def _failed(session: Session, row: DeliveryAttempt, *, spec: ConsumerSpec, raw: str, type_: str | None,
            headers: Mapping[str, Any], error: str, clock: Clock, limit: int, retry_in_s: float) -> Delivery:
    now = clock.now_ms()
    try:
        attempts.fail(session, row, error=error, now_ms=now)
        if row.deliveries >= limit:
            dead_letters.record(
                session, consumer=spec.name, message_id=str(row.message_id), type=type_, body=raw, headers=headers,
                delivery_count=row.deliveries, last_error=error, first_failed_at_ms=row.first_failed_at_ms,
                last_failed_at_ms=now,
            )
            session.commit()
            return Delivery(outcome=Outcome.DEAD_LETTERED, deliveries=row.deliveries, error=error)
        session.commit()
    except Exception as e:  # the failure could not even be recorded: redeliver, counted at the next begin
        session.rollback()
        return Delivery(outcome=Outcome.RETRY, deliveries=row.deliveries, error=f"{error} (and {e})",
                        retry_in_s=retry_in_s)
    return Delivery(outcome=Outcome.RETRY, deliveries=row.deliveries, error=error, retry_in_s=retry_in_s)


def _worker_lost(session: Session, row: DeliveryAttempt, *, spec: ConsumerSpec, raw: str, type_: str | None,
                 headers: Mapping[str, Any], clock: Clock, limit: int) -> Delivery:
    """More deliveries than allowed: earlier ones died without recording an outcome (killed worker),
    or this message is already dead-lettered and came back (a crash before the ack), or it was
    processed and the worker died between the inbox commit and the ack."""
    if already_seen(session, row.message_id, spec.name):
        session.rollback()
        increment_counter(session, spec.name, DUPLICATES)
        attempts.forget(session, key=row.message_id, consumer=spec.name)
        return Delivery(outcome=Outcome.DUPLICATE, deliveries=row.deliveries)
    if dead_letters.is_open(session, consumer=spec.name, message_id=str(row.message_id)):
        session.rollback()
        return Delivery(outcome=Outcome.DEAD_LETTERED, deliveries=row.deliveries - 1,
                        error="already in the dead-letter store")
    error = (f"delivered {row.deliveries - 1} times (max {limit}) without an outcome: the worker was lost "
             f"(killed or crashed) during the delivery; last recorded error: {row.last_error or 'none'}")
    now = clock.now_ms()
    dead_letters.record(
        session, consumer=spec.name, message_id=str(row.message_id), type=type_, body=raw, headers=headers,
        delivery_count=row.deliveries - 1, last_error=error, first_failed_at_ms=row.first_failed_at_ms,
        last_failed_at_ms=now,
    )
    attempts.fail(session, row, error=error, now_ms=now)
    session.commit()
    return Delivery(outcome=Outcome.DEAD_LETTERED, deliveries=row.deliveries - 1, error=error)


def register(app: Any, settings: Settings, *, registry: ConsumerRegistry | None = None,
             clock: Clock | None = None) -> None:
    """Define ``consumers.<name>`` on ``app`` for each configured consumer that has a handler."""
    registry = registry if registry is not None else default_registry()
    clock = clock or SystemClock()
    sessions = SessionSource(url=settings.effective_database_url)
    crash_points = CrashPoints(spec=settings.crash_points)
    routes: dict[str, dict[str, str]] = {}
    for name in settings.consumers:
        spec = registry.get(name)
        if spec is not None:
            _define(app, settings, spec, sessions=sessions, clock=clock, crash_points=crash_points)
            routes[task_name(name)] = {"queue": settings.queue_name(name)}
    add_task_routes(app, routes)


def _define(app: Any, settings: Settings, spec: ConsumerSpec, *, sessions: SessionSource, clock: Clock,
            crash_points: CrashSite) -> None:
    @app.task(  # type: ignore[untyped-decorator]
        name=task_name(spec.name), bind=True, acks_late=True,
        reject_on_worker_lost=True, ignore_result=True, max_retries=None, shared=False,
    )
    def run(self: Any, body: Any) -> str:
        try:
            info = self.request.delivery_info or {}
            result = deliver(sessions(), spec, body, request_id=self.request.id, settings=settings, clock=clock,
                             crash_points=crash_points, first_delivery=not self.request.retries,
                             redelivered=bool(info.get("redelivered")))
        except Exception as e:  # never let a failure escape: acks_late would ack (and drop) the message
            result = Delivery(outcome=Outcome.RETRY, deliveries=0, error=f"{e.__class__.__name__}: {e}",
                              retry_in_s=backoff_s(1, base_s=settings.consumer_retry_backoff_s,
                                                   max_s=settings.consumer_retry_backoff_max_s))
        if result.retry_in_s is not None:
            raise self.retry(countdown=result.retry_in_s, max_retries=None,
                             exc=_RedeliveryError(result.error or "failed"))
        _announce(app, spec.name, body, result)
        return result.outcome.value


class _RedeliveryError(Exception):
    """Carries the failure text into Celery's retry log line (JSON-safe, no driver objects)."""
