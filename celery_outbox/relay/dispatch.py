"""One relay batch: claim due rows, publish FIRST, mark AFTER (docs/design.md, rule 2-5).

``dispatch_batch`` is a plain function (no Celery, host or timer) so the beat task, the standalone
loop, the tests and the benchmark all run exactly the same code. Its order is the whole point: a
crash after publishing and before marking re-publishes the batch (a duplicate the inbox absorbs);
marking first would lose it. The steps are public (``claim_due``, ``build_messages``,
``mark_batch``) so a test can assemble the wrong order on purpose and watch it lose a message.

On Postgres the rows are claimed with ``FOR UPDATE SKIP LOCKED`` in the transaction that later
marks them, so concurrent relays take disjoint rows. On SQLite (a single relay by design) the read
transaction is committed before publishing so the database's one write lock is not held across
broker I/O.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox import counters, tracing
from celery_outbox.clock import Clock
from celery_outbox.db import is_postgres, wrap_driver_errors
from celery_outbox.errors import BrokerUnavailableError, MalformedMessageError, MessageTooLargeError, SerializationError
from celery_outbox.messages import Envelope, TaskMessage, celery_task_messages, is_task_row, task_row_message
from celery_outbox.relay.breaker import CircuitBreaker
from celery_outbox.relay.publisher import Publisher
from celery_outbox.relay.queries import due_pending
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings

log = logging.getLogger("celery_outbox.relay.dispatch")

class CrashPointsLike(Protocol):
    def reached(self, name: str) -> None: ...


@dataclass(frozen=True, kw_only=True)
class ClaimedRow:
    """A plain copy of a claimed row, safe to use after the claiming transaction is committed."""

    seq: int
    message_id: uuid.UUID
    type: str
    payload: Any
    headers: dict[str, Any]
    created_at_ms: int
    attempts: int


@dataclass(frozen=True, kw_only=True)
class Built:
    """Broker messages for a batch: ``owners[i]`` is the index in ``rows`` of ``messages[i]``."""

    rows: tuple[ClaimedRow, ...]
    messages: tuple[TaskMessage, ...]
    owners: tuple[int, ...]
    unpublishable: Mapping[int, str]  # row index -> why it can never be published


@dataclass(kw_only=True)
class BatchResult:
    """What one batch did. ``broker_unavailable`` means: back off, nothing was charged to rows."""

    claimed: int = 0
    published: int = 0
    failed: int = 0  # rejected by the broker, charged an attempt, will be retried after backoff
    dead_lettered: int = 0
    messages_sent: int = 0  # broker messages confirmed (one per row and consumer)
    broker_unavailable: bool = False
    breaker_open: bool = False  # the breaker refused to publish; nothing was claimed
    duplicates_risked: int = 0  # rows the broker may already hold that stay pending (sent again)
    already_published: int = 0  # rows another relay marked first: a double publish happened
    error: str | None = None
    dead_lettered_rows: list[tuple[str, str]] = field(default_factory=list)  # (message_id, why)

    @property
    def drained(self) -> bool:
        """No more due work right now: fewer rows than asked for, or the broker is away."""
        return self.broker_unavailable or self.claimed == 0


def backoff_ms(attempts: int, *, base_delay_ms: int, max_delay_ms: int) -> int:
    """``base * 2**(attempts-1)`` capped at ``max``: the delay after the ``attempts``-th failure."""
    delay: int = base_delay_ms * 2 ** min(max(attempts - 1, 0), 62)
    return min(max_delay_ms, delay)


def claim_due(session: Session, now_ms: int, limit: int, *, tables: Tables) -> list[ClaimedRow]:
    """Select (and on Postgres lock, skipping rows other relays hold) up to ``limit`` due rows."""
    with wrap_driver_errors("claiming due outbox rows"):
        rows = session.execute(due_pending(now_ms, limit, tables=tables, skip_locked=is_postgres(session))).scalars().all()
        return [
            ClaimedRow(seq=r.seq, message_id=r.message_id, type=r.type, payload=r.payload,
                       headers=dict(r.headers or {}), created_at_ms=r.created_at_ms, attempts=r.attempts)
            for r in rows
        ]


def build_messages(rows: Sequence[ClaimedRow], routes: Mapping[str, Sequence[str]], namespace: str,
                   max_message_bytes: int) -> Built:
    """One Celery task message per (row, routed consumer); rows that can never go out are set aside.

    A row holding a task enqueued through the outbox (``messages.is_task_row``) is ONE message, to
    the task's own exchange, routing key and queue as Celery resolved them at enqueue time; event
    routes play no part in it.
    """
    messages: list[TaskMessage] = []
    owners: list[int] = []
    unpublishable: dict[int, str] = {}
    for i, row in enumerate(rows):
        if is_task_row(row.headers):
            try:
                task = task_row_message(message_id=row.message_id, type=row.type, payload=row.payload,
                                        headers=row.headers, max_bytes=max_message_bytes)
            except (SerializationError, MessageTooLargeError, MalformedMessageError) as e:
                unpublishable[i] = f"unpublishable task: {e}"
                continue
            messages.append(task)
            owners.append(i)
            continue
        consumers = routes.get(row.type)
        if not consumers:
            unpublishable[i] = f"no route for event type {row.type!r}: add it to OUTBOX_ROUTES, then replay"
            continue
        envelope = Envelope(message_id=row.message_id, type=row.type, payload=row.payload,
                            headers=row.headers, created_at_ms=row.created_at_ms)
        try:
            built = celery_task_messages(envelope, targets=[(c, f"{namespace}.{c}") for c in consumers],
                                         max_bytes=max_message_bytes)
        except (SerializationError, MessageTooLargeError) as e:
            unpublishable[i] = f"unpublishable: {e}"
            continue
        messages.extend(built)
        owners.extend([i] * len(built))
    return Built(rows=tuple(rows), messages=tuple(messages), owners=tuple(owners), unpublishable=unpublishable)


def mark_batch(session: Session, now_ms: int, *, tables: Tables, published: Sequence[ClaimedRow],
               failed: Mapping[int, tuple[ClaimedRow, str]], max_attempts: int, base_delay_ms: int,
               max_delay_ms: int, dead_now: Mapping[int, tuple[ClaimedRow, str]] | None = None,
               ) -> tuple[int, int, int]:
    """Mark in the current transaction (the caller commits): returns (marked, failed, dead_lettered).

    Published rows: ONE UPDATE. Failed rows: one executemany UPDATE charging an attempt (backoff,
    dead letter at ``max_attempts``). ``dead_now`` rows are dead-lettered whatever their attempts.
    """
    marked = n_failed = n_dead = 0
    outbox = tables.table(tables.outbox)
    with wrap_driver_errors("marking outbox rows"):
        if published:
            res = session.execute(
                sa.update(outbox)
                .where(outbox.c.seq.in_([r.seq for r in published]), outbox.c.published_at_ms.is_(None))
                .values(published_at_ms=now_ms)
            )
            marked = int(getattr(res, "rowcount", 0) or 0)
        params: list[dict[str, Any]] = []
        for row, error in failed.values():
            attempts = row.attempts + 1
            dead = attempts >= max_attempts
            n_dead += dead
            n_failed += not dead
            params.append({"b_seq": row.seq, "b_attempts": attempts, "b_error": error[:2000],
                           "b_next": now_ms + backoff_ms(attempts, base_delay_ms=base_delay_ms,
                                                         max_delay_ms=max_delay_ms),
                           "b_dead": now_ms if dead else None})
            if dead:
                log.warning("outbox row seq=%s message_id=%s dead-lettered after %s attempts: %s",
                            row.seq, row.message_id, attempts, error)
        for row, error in (dead_now or {}).values():
            n_dead += 1
            params.append({"b_seq": row.seq, "b_attempts": row.attempts + 1, "b_error": error[:2000],
                           "b_next": now_ms, "b_dead": now_ms})
            log.warning("outbox row seq=%s message_id=%s dead-lettered: %s", row.seq, row.message_id, error)
        if params:
            session.connection().execute(
                sa.update(outbox)
                .where(outbox.c.seq == sa.bindparam("b_seq"), outbox.c.published_at_ms.is_(None))
                .values(attempts=sa.bindparam("b_attempts"), last_error=sa.bindparam("b_error"),
                        next_attempt_at_ms=sa.bindparam("b_next"),
                        dead_lettered_at_ms=sa.bindparam("b_dead")),
                params,
            )
    return marked, n_failed, n_dead


def dispatch_batch(session: Session, publisher: Publisher, clock: Clock, *, tables: Tables, batch_size: int,
                   max_attempts: int, base_delay_ms: int, max_delay_ms: int,
                   routes: Mapping[str, Sequence[str]], max_message_bytes: int, namespace: str = "outbox",
                   breaker: CircuitBreaker | None = None, crash_points: CrashPointsLike | None = None,
                   ) -> BatchResult:
    """Claim up to ``batch_size`` due rows in seq order, publish them, then mark them in one commit.

    ``namespace`` names the queues (``<namespace>.<consumer>``, as ``Settings.queue_name``). A broker
    outage (``BrokerUnavailableError``) leaves every row as it was, trips ``breaker`` and returns
    ``broker_unavailable=True``; it is never charged to a row. Any other exception rolls back (on
    Postgres releasing the claim) and propagates.
    """
    now = clock.now_ms()
    result = BatchResult()
    if breaker is not None and not breaker.allow(now):
        result.broker_unavailable = result.breaker_open = True
        result.error = breaker.last_error
        return result
    limit = breaker.batch_limit(now, batch_size) if breaker is not None else batch_size
    postgres = is_postgres(session)
    spans = tracing.NO_RELAY_SPANS  # one span per row when OpenTelemetry is configured (tracing.py)
    try:
        rows = claim_due(session, now, limit, tables=tables)
        result.claimed = len(rows)
        if not rows:
            session.commit()
            return result
        if not postgres:
            session.commit()  # SQLite: single relay; do not hold the write lock across broker I/O
        if crash_points is not None:
            crash_points.reached("after_claim_before_publish")
        spans = tracing.relay_spans(rows, routes=routes, namespace=namespace)
        built = spans.build(rows, lambda rs: build_messages(rs, routes=routes, namespace=namespace,
                                                           max_message_bytes=max_message_bytes))
        rejected_rows: dict[int, tuple[ClaimedRow, str]] = {}
        if built.messages:
            try:
                report = publisher.publish_batch(built.messages)
            except BrokerUnavailableError as e:
                session.rollback()
                result.broker_unavailable = True
                result.error = str(e)
                result.duplicates_risked = len(rows) - len(built.unpublishable)
                if breaker is not None:
                    breaker.record_failure(clock.now_ms(), str(e))
                log.warning("broker unavailable, %s row(s) left pending: %s", result.duplicates_risked, e)
                spans.fail("broker_unavailable", str(e))
                counters.increment(session, counters.RELAY, counters.BROKER_UNAVAILABLE, tables=tables)
                return result
            for index, error in report.rejected.items():
                owner = built.owners[index]
                if owner not in rejected_rows:
                    rejected_rows[owner] = (rows[owner], f"{built.messages[index].consumer}: {error}")
            result.messages_sent = len(report.confirmed)
        if breaker is not None:
            breaker.record_success()
        if crash_points is not None:
            crash_points.reached("after_publish_before_mark")
        done = clock.now_ms()
        published = [r for i, r in enumerate(rows) if i not in built.unpublishable and i not in rejected_rows]
        dead_now = {i: (rows[i], why) for i, why in built.unpublishable.items()}
        marked, result.failed, result.dead_lettered = mark_batch(
            session, done, tables=tables, published=published, failed=rejected_rows, dead_now=dead_now,
            max_attempts=max_attempts, base_delay_ms=base_delay_ms, max_delay_ms=max_delay_ms)
        with wrap_driver_errors("counting the relay batch"):
            counters.stage_increment(session, counters.RELAY, counters.PUBLISHED, marked, tables=tables)
            counters.stage_increment(session, counters.RELAY, counters.PUBLISH_FAILURES, len(rejected_rows), tables=tables)
            counters.stage_increment(session, counters.RELAY, counters.DEAD_LETTERED, result.dead_lettered, tables=tables)
        with wrap_driver_errors("committing the relay batch"):
            session.commit()
        spans.finish(rejected=rejected_rows, dead_now=dead_now, max_attempts=max_attempts)
        result.dead_lettered_rows = [(str(r.message_id), why) for r, why in dead_now.values()] + [
            (str(r.message_id), why) for r, why in rejected_rows.values() if r.attempts + 1 >= max_attempts]
        result.published = marked
        result.already_published = len(published) - marked
        if result.already_published:
            log.warning("%s row(s) were published by another relay too (duplicates)", result.already_published)
        if crash_points is not None:
            crash_points.reached("after_mark")
        return result
    except BaseException as e:
        spans.fail("error", e.__class__.__name__)
        try:
            session.rollback()
        except Exception:  # the connection may be gone; the original error matters more
            log.debug("rollback after a failed batch failed", exc_info=True)
        raise


def dispatch_with_settings(session: Session, publisher: Publisher, clock: Clock, settings: Settings, *,
                           tables: Tables, breaker: CircuitBreaker | None = None, crash_points: CrashPointsLike | None = None,
                           batch_size: int | None = None,
                           routes: Mapping[str, Sequence[str]] | None = None) -> BatchResult:
    """``dispatch_batch`` with every knob taken from ``settings``."""
    return dispatch_batch(
        session, publisher, clock, tables=tables, batch_size=batch_size or settings.relay_batch_size,
        max_attempts=settings.relay_max_attempts, base_delay_ms=settings.relay_base_delay_ms,
        max_delay_ms=settings.relay_max_delay_ms, routes=settings.routes if routes is None else routes,
        max_message_bytes=settings.max_message_bytes, namespace=settings.namespace,
        breaker=breaker, crash_points=crash_points)


def breaker_from_settings(settings: Settings) -> CircuitBreaker:
    return CircuitBreaker(base_ms=settings.relay_breaker_base_ms, max_ms=settings.relay_breaker_max_ms)
