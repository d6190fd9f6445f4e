"""One relay batch: claim due rows, publish FIRST, mark AFTER (docs/design.md, rule 2-5).

``dispatch_batch`` is a plain function (no Celery, host or timer) so the beat task, the standalone
loop, the tests and the benchmark all run exactly the same code. Its order is the whole point: a
crash after publishing and before marking re-publishes the batch (a duplicate the inbox absorbs);
marking first would lose it. The steps are public (``claim_due``, ``build_messages``,
``mark_batch``, ``mark_rows``) so a test can assemble the wrong order on purpose and watch it lose a message.

On Postgres the rows are claimed with ``FOR UPDATE SKIP LOCKED`` in the transaction that later
marks them, so concurrent relays take disjoint rows. On SQLite (a single relay by design) the read
transaction is committed before publishing so the database's one write lock is not held across
broker I/O.

On Postgres, a batch claimed with nothing of its relay in flight is stamped published by its claim
(``queries.claim_mark_pg``: one statement claims, stamps, counts and reads the next due time), and its
transaction commits only after the broker confirmed it: what is committed is still publish first, mark
after, and a crash or a failed publish rolls the stamp back (the rows stay pending, published again).
Rows the broker did not take are given back (``queries.unstamp_pg``) and then charged, held or
dead-lettered as ``mark_rows`` does, in that same transaction; a batch confirmed more than
``STAMP_SLACK_MS`` after its claim is stamped again at its confirm time.

One module, though long: claim, send, finish and mark are the relay's one ordered step (publish first, mark
after) and share the claimed rows' shape; the steps stay public here so a test can assemble the wrong order on
purpose.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from celery_outbox import counters, tracing, workers
from celery_outbox.clock import Clock
from celery_outbox.db import is_postgres, wrap_driver_errors
from celery_outbox.errors import BrokerUnavailableError, MalformedMessageError, MessageTooLargeError, SerializationError
from celery_outbox.messages import Envelope, TaskMessage, celery_task_messages, is_task_row, task_row_message
from celery_outbox.prepared import Prepared
from celery_outbox.relay.breaker import CircuitBreaker
from celery_outbox.relay.publisher import Publisher, PublishReport, SendsAhead
from celery_outbox.relay.queries import RelayStatements, due_pending, mark_published_pg
from celery_outbox.relay.undecodable import UNDECODABLE, dead_letter_undecodable
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings
from celery_outbox.sql import translates_schema

log = logging.getLogger("celery_outbox.relay.dispatch")

# A batch stamped at its claim (``claim_batch``) whose confirm came later than this is stamped again at its
# confirm time: a row's ``published_at_ms`` is never more than this before the broker had the message (the
# reconciler's publish skew adds it: relay/loop.py ``publish_skew_ms``), nor before its claim.
STAMP_SLACK_MS = 100

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
    # why the stored row can never be published (``build_messages`` dead-letters it), None when it can
    problem: str | None = None

    @classmethod
    def of(cls, columns: Sequence[Any]) -> ClaimedRow:
        """The row from a claim's columns, in ``queries.CLAIM_COLUMNS`` order (both claims read them so).

        Headers that are no JSON object (a row another writer stored) are read as none, with the ``problem``
        that dead-letters the row: raised here, they failed every batch holding the row, so nothing behind it
        was published."""
        seq, message_id, type_, payload, headers, created_at_ms, attempts = columns
        problem = None
        if headers is not None and not isinstance(headers, Mapping):
            headers, problem = None, f"headers must be a JSON object, got {type(headers).__name__}"
        return cls(seq=seq, message_id=message_id, type=type_, payload=payload, headers=dict(headers or {}),
                   created_at_ms=created_at_ms, attempts=attempts, problem=problem)


@dataclass(frozen=True, kw_only=True)
class Built:
    """Broker messages for a batch: ``owners[i]`` is the index in ``rows`` of ``messages[i]``."""

    rows: tuple[ClaimedRow, ...]
    messages: tuple[TaskMessage, ...]
    owners: tuple[int, ...]
    unpublishable: Mapping[int, str]  # row index -> why it can never be published
    # row index -> the worker it waits for (a task no live worker of its queue runs yet; workers.py)
    held: Mapping[int, str] = field(default_factory=lambda: MappingProxyType({}))


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
    held: int = 0  # task rows waiting for a worker that runs them (no attempt charged; workers.py)
    error: str | None = None
    dead_lettered_rows: list[tuple[str, str]] = field(default_factory=list)  # (message_id, why)
    # Postgres: the mark also read the earliest due time of the other pending rows (None: none pending);
    # ``next_due_read`` says it did. The standalone relay sleeps until then (relay/loop.py).
    next_due_ms: int | None = None
    next_due_read: bool = False

    @property
    def drained(self) -> bool:
        """No more due work right now: fewer rows than asked for, or the broker is away."""
        return self.broker_unavailable or self.claimed == 0


def backoff_ms(attempts: int, *, base_delay_ms: int, max_delay_ms: int) -> int:
    """``base * 2**(attempts-1)`` capped at ``max``: the delay after the ``attempts``-th failure."""
    delay: int = base_delay_ms * 2 ** min(max(attempts - 1, 0), 62)
    return min(max_delay_ms, delay)


def _driver_sql(connection: sa.Connection, sql: str | None) -> str | None:
    """``RelayStatements``' compiled text, unless the connection rewrites the statements it runs (a
    ``schema_translate_map``, which compiled text would bypass): then None, and SQLAlchemy runs them."""
    if sql is None or translates_schema(connection):
        return None
    return sql


def claim_due(session: Session, now_ms: int, limit: int, *, tables: Tables,
              statements: RelayStatements | None = None) -> list[ClaimedRow]:
    """Select (and on Postgres lock, skipping rows other relays hold) up to ``limit`` due rows.

    Core rows (``due_pending`` selects columns), copied once into ``ClaimedRow``: no ORM identity
    map, no instance state, nothing to expire at commit (ORM loading cost a sixth of a batch:
    docs/benchmarks.md). ``statements`` (built for this session's dialect) runs its prebuilt claim instead.
    """
    with wrap_driver_errors("claiming due outbox rows"):
        result: Any
        connection = session.connection()
        if statements is not None and (sql := _driver_sql(connection, statements.claim_sql)) is not None:
            result = connection.exec_driver_sql(sql, {"now_ms": now_ms, "claim_limit": limit})
        elif statements is not None:
            result = connection.execute(statements.claim, {"now_ms": now_ms, "claim_limit": limit})
        else:
            result = session.execute(due_pending(now_ms, limit, tables=tables, skip_locked=is_postgres(session)))
        return [ClaimedRow.of(columns) for columns in result]


def claimed_and_stamped(session: Session, sql: str, now_ms: int, limit: int, *,
                        prepared: Prepared | None = None) -> tuple[list[ClaimedRow], int | None, str | None]:
    """Postgres: claim up to ``limit`` due rows and stamp them published at ``now_ms`` in one statement
    (``queries.claim_mark_pg``, compiled ``sql``; ``prepared``: the same as a server-side prepared statement),
    the first of the session's transaction (the caller commits only after the broker confirmed them).
    Returns the rows, the next due time of the other pending rows and the counter row the count went to."""
    params = {"now_ms": now_ms, "claim_limit": limit, "scope": counters.RELAY, "name": counters.PUBLISHED,
              "stripe": counters.stripe_prefix(counters.PUBLISHED)}
    result: Sequence[Any]
    with wrap_driver_errors("claiming due outbox rows"):
        try:
            cursor: Any = prepared.execute(session.connection(), params) if prepared is not None \
                else session.connection().exec_driver_sql(sql, params)
            result = cursor.all()
        except sa.exc.DBAPIError as e:
            if prepared is None or not prepared.lost(e):
                raise
            session.rollback()  # the claim is the transaction's first statement: nothing else is lost
            cursor = prepared.execute(session.connection(), params)  # off now: the text
            result = cursor.all()
    due, stripe = result[0][0], result[0][1]
    rows = [ClaimedRow.of(columns[2:]) for columns in result if columns[2] is not None]
    return rows, None if due is None else int(due), None if stripe is None else str(stripe)


@dataclass(frozen=True, kw_only=True)
class DeployHold:
    """Deploy-safe publishing (celery_outbox/workers.py): read the live workers' registry (expired after
    3 x ``heartbeat_ms``) and hold a task row none of them can run for ``recheck_ms``."""

    heartbeat_ms: int
    recheck_ms: int


@dataclass(frozen=True, kw_only=True)
class RelayConfig:
    """What every batch of one relay shares, built once (``from_settings``) and passed down the claim,
    send, finish and mark steps.

    ``routes``: event type -> consumer names; ``namespace`` names the queues (``<namespace>.<consumer>``,
    as ``Settings.queue_name``); a rejected row is due again after ``backoff_ms`` of its attempts and
    dead-lettered at ``max_attempts``; ``hold``: deploy-safe publishing (None: off); ``statements``: the
    claim, mark and next-due read built once for the relay's dialect (None: built per batch).
    """

    tables: Tables
    routes: Mapping[str, Sequence[str]]
    namespace: str = "outbox"
    max_message_bytes: int
    max_attempts: int
    base_delay_ms: int
    max_delay_ms: int
    hold: DeployHold | None = None
    statements: RelayStatements | None = None

    @classmethod
    def from_settings(cls, settings: Settings, *, tables: Tables, routes: Mapping[str, Sequence[str]] | None = None,
                      statements: RelayStatements | None = None) -> RelayConfig:
        return cls(tables=tables, routes=settings.routes if routes is None else routes, namespace=settings.namespace,
                   max_message_bytes=settings.max_message_bytes, max_attempts=settings.relay_max_attempts,
                   base_delay_ms=settings.relay_base_delay_ms, max_delay_ms=settings.relay_max_delay_ms,
                   hold=hold_from_settings(settings), statements=statements)


REGISTRY_TTL_MS = 1_000  # the longest ``RegistryCache`` answers from memory (at most a tenth of a heartbeat)


class RegistryCache:
    """The last worker registry a relay read, reused for ``ttl_ms`` by batches it holds nothing of.

    The standalone relay claims once per wake-up, often one commit's rows: reading the
    registry for each costs three statements (savepoint, select, release). Reused only when it lets
    every task row of the batch go out: any row it would hold is decided on a fresh read, so the cache
    never holds a row the registry would let go. What it can miss is a change younger than ``ttl_ms``
    that would hold a row: a worker that registered within ``ttl_ms`` (the same as publishing that
    row ``ttl_ms`` earlier, before the worker existed, which the hold never covered) or a worker
    that expired within it (expiry itself lags 3 heartbeats). Its clock is the relay's.
    """

    def __init__(self, *, ttl_ms: int) -> None:
        self.ttl_ms = ttl_ms
        self._read_at_ms: int | None = None
        self._registry: workers.Registry = workers.EMPTY
        self.hits = 0
        self.reads = 0

    @classmethod
    def for_hold(cls, hold: DeployHold) -> RegistryCache:
        return cls(ttl_ms=max(0, min(REGISTRY_TTL_MS, hold.heartbeat_ms // 10)))

    def fresh(self, now_ms: int) -> workers.Registry | None:
        """The cached registry when read less than ``ttl_ms`` ago (by ``now_ms``), else None."""
        at = self._read_at_ms
        if at is None or not 0 <= now_ms - at < self.ttl_ms:
            return None
        return self._registry

    def store(self, now_ms: int, registry: workers.Registry) -> None:
        self._read_at_ms, self._registry = now_ms, registry
        self.reads += 1


def _held_by(registry: workers.Registry, tasks: Sequence[tuple[int, ClaimedRow]]) -> dict[int, str]:
    out: dict[int, str] = {}
    if not registry.queues:
        return out
    for i, row in tasks:
        queue, version = workers.row_target(row.headers)
        why = None if queue is None else registry.why_held(queue=queue, task=row.type, version=version)
        if why is not None:
            out[i] = why
    return out


def held_rows(session: Session, rows: Sequence[ClaimedRow], now_ms: int, *, hold: DeployHold | None,
              tables: Tables, cache: RegistryCache | None = None) -> dict[int, str]:
    """Row index -> what it waits for, for the task rows of ``rows`` that some live registered worker of
    their queue cannot run. One read of the registry, only when the batch holds task rows (with ``cache``,
    none while its registry is fresh and holds none of them); a registry that cannot be read (no table
    yet) holds nothing, logged."""
    tasks = [(i, r) for i, r in enumerate(rows) if is_task_row(r.headers)]
    if hold is None or not tasks:
        return {}
    if cache is not None:
        cached = cache.fresh(now_ms)
        if cached is not None and not _held_by(cached, tasks):
            cache.hits += 1
            return {}
    try:
        if is_postgres(session):  # a failed read must not abort the claim's transaction (and its row locks)
            with session.begin_nested():
                registry = workers.live(session, now_ms, heartbeat_ms=hold.heartbeat_ms, tables=tables)
        else:
            registry = workers.live(session, now_ms, heartbeat_ms=hold.heartbeat_ms, tables=tables)
    except Exception as e:  # e.g. code deployed before `outbox db upgrade`: never stall the relay for it
        log.warning("the worker registry cannot be read, no task is held for a worker (run `outbox db upgrade`?): "
                    "%s: %s", type(e).__name__, e)
        return {}
    if cache is not None:
        cache.store(now_ms, registry)
    return _held_by(registry, tasks)


def build_messages(rows: Sequence[ClaimedRow], routes: Mapping[str, Sequence[str]], namespace: str,
                   max_message_bytes: int, held: Mapping[int, str] | None = None) -> Built:
    """One Celery task message per (row, routed consumer); rows that can never go out are set aside.

    A row holding a task enqueued through the outbox (``messages.is_task_row``) is ONE message, to
    the task's own exchange, routing key and queue as Celery resolved them at enqueue time; event
    routes play no part in it. ``held`` rows (waiting for a worker that runs them) get no message.
    """
    messages: list[TaskMessage] = []
    owners: list[int] = []
    unpublishable: dict[int, str] = {}
    held = held or {}
    for i, row in enumerate(rows):
        if i in held:
            continue
        if row.problem is not None:
            unpublishable[i] = f"unpublishable: {row.problem}"
            continue
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
    return Built(rows=tuple(rows), messages=tuple(messages), owners=tuple(owners), unpublishable=unpublishable,
                 held=MappingProxyType(dict(held)))


@dataclass(frozen=True, kw_only=True)
class Marked:
    """What ``mark_rows`` did; ``next_due_read``: the Postgres mark also read ``next_due_ms``."""

    marked: int
    failed: int
    dead_lettered: int
    next_due_ms: int | None = None
    next_due_read: bool = False
    # the earliest time a row charged an attempt (not dead) or held here is due again (None: none)
    rescheduled_ms: int | None = None


def mark_batch(session: Session, now_ms: int, config: RelayConfig, *, published: Sequence[ClaimedRow],
               failed: Mapping[int, tuple[ClaimedRow, str]], dead_now: Mapping[int, tuple[ClaimedRow, str]] | None = None,
               count: bool = False, held: Sequence[tuple[ClaimedRow, str]] = (), held_until_ms: int = 0,
               ) -> tuple[int, int, int]:
    """``mark_rows`` returning (marked, failed, dead_lettered); the caller commits."""
    m = mark_rows(session, now_ms, config, published=published, failed=failed, dead_now=dead_now, count=count,
                  held=held, held_until_ms=held_until_ms)
    return m.marked, m.failed, m.dead_lettered


def mark_rows(session: Session, now_ms: int, config: RelayConfig, *, published: Sequence[ClaimedRow],
              failed: Mapping[int, tuple[ClaimedRow, str]], dead_now: Mapping[int, tuple[ClaimedRow, str]] | None = None,
              count: bool = False, held: Sequence[tuple[ClaimedRow, str]] = (), held_until_ms: int = 0) -> Marked:
    """Mark in the current transaction (the caller commits).

    Failed rows: one executemany UPDATE charging an attempt (backoff, dead letter at
    ``config.max_attempts``). ``dead_now`` rows are dead-lettered whatever their attempts. ``held`` rows
    (waiting for a worker that runs them) are due again at ``held_until_ms`` with what they wait for
    in ``held_for``, their attempts untouched (a deploy is not their failure). Published rows, last:
    ONE statement with one array parameter (Postgres, ``= ANY(:ids)``; with ``count`` the relay's
    ``published`` counter is added and the next due time read in that same statement, which sees the
    updates above) or one ``IN`` UPDATE (SQLite, counter staged after it). ``config.statements``: the
    prebuilt Postgres mark (``RelayStatements``).
    """
    tables, statements = config.tables, config.statements
    max_attempts, base_delay_ms, max_delay_ms = config.max_attempts, config.base_delay_ms, config.max_delay_ms
    marked = n_failed = n_dead = 0
    next_due: int | None = None
    due_read = False
    again: list[int] = [held_until_ms] if held else []  # when the rows charged or held here are due again
    outbox = tables.table(tables.outbox)
    with wrap_driver_errors("marking outbox rows"):
        params: list[dict[str, Any]] = []
        for row, error in failed.values():
            attempts = row.attempts + 1
            dead = attempts >= max_attempts
            n_dead += dead
            n_failed += not dead
            due_again = now_ms + backoff_ms(attempts, base_delay_ms=base_delay_ms, max_delay_ms=max_delay_ms)
            if not dead:
                again.append(due_again)
            params.append({"b_seq": row.seq, "b_attempts": attempts, "b_error": error[:2000], "b_next": due_again,
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
                        dead_lettered_at_ms=sa.bindparam("b_dead"),
                        # a dead row gives its dedup key up (kept in its headers): its replay never
                        # conflicts with a newer pending task of that key (celery_outbox/dedup.py)
                        dedup_key=sa.case((sa.bindparam("b_dead", type_=sa.BigInteger).is_(None), outbox.c.dedup_key),
                                          else_=sa.null())),
                params,
            )
        if held:
            session.connection().execute(
                sa.update(outbox)
                .where(outbox.c.seq == sa.bindparam("h_seq"), outbox.c.published_at_ms.is_(None))
                .values(next_attempt_at_ms=held_until_ms, held_for=sa.bindparam("h_why")),
                [{"h_seq": row.seq, "h_why": why[:300]} for row, why in held])
        if published and is_postgres(session):
            ids = [r.seq for r in published]
            if count:
                mark_params = {"now": now_ms, "ids": ids, "scope": counters.RELAY, "name": counters.PUBLISHED,
                               "stripe": counters.stripe_prefix(counters.PUBLISHED)}
                connection = session.connection()
                if statements is not None and (sql := _driver_sql(connection, statements.mark_sql)) is not None:
                    stamped, due = connection.exec_driver_sql(sql, mark_params).one()
                else:
                    mark = statements.mark if statements is not None and statements.mark is not None else \
                        mark_published_pg(tables, session.get_bind().dialect)
                    stamped, due = connection.execute(mark, mark_params).one()
                marked, next_due, due_read = int(stamped), None if due is None else int(due), True
            else:
                res = session.execute(
                    sa.update(outbox)
                    .where(outbox.c.seq == sa.any_(sa.bindparam("ids", type_=ARRAY(sa.BigInteger))),
                           outbox.c.published_at_ms.is_(None))
                    .values(published_at_ms=now_ms), {"ids": ids})
                marked = int(getattr(res, "rowcount", 0) or 0)
        elif published:
            res = session.execute(
                sa.update(outbox)
                .where(outbox.c.seq.in_([r.seq for r in published]), outbox.c.published_at_ms.is_(None))
                .values(published_at_ms=now_ms)
            )
            marked = int(getattr(res, "rowcount", 0) or 0)
            if count:
                counters.stage_increment(session, counters.RELAY, counters.PUBLISHED, marked, tables=tables)
    return Marked(marked=marked, failed=n_failed, dead_lettered=n_dead, next_due_ms=next_due,
                  next_due_read=due_read, rescheduled_ms=min(again) if again else None)


def settle_stamped(claimed: Claimed, now_ms: int, config: RelayConfig, *, published: Sequence[ClaimedRow],
                   failed: Mapping[int, tuple[ClaimedRow, str]], dead_now: Mapping[int, tuple[ClaimedRow, str]],
                   held: Sequence[tuple[ClaimedRow, str]], held_until_ms: int) -> Marked:
    """``mark_rows`` for a batch its claim stamped published (``claimed.stamped_at_ms``), at ``now_ms``, after
    the broker's answer; the caller commits.

    Every row published and confirmed within ``STAMP_SLACK_MS`` of the claim: nothing to run, the claim
    did it all. Otherwise ONE statement (``queries.unstamp_pg``) gives the other rows their pending state
    back (and takes them off the ``published`` counter) and, for a late confirm, stamps the published rows
    at ``now_ms``; then the failed, dead and held rows are charged, dead-lettered or held exactly as
    ``mark_rows`` does. The next due time is the claim's, or earlier when a row given back is due sooner.
    """
    statements = config.statements
    assert statements is not None and statements.unstamp is not None and claimed.stamped_at_ms is not None
    back = [r.seq for r, _ in failed.values()] + [r.seq for r, _ in dead_now.values()] + [r.seq for r, _ in held]
    keep = [r.seq for r in published] if now_ms - claimed.stamped_at_ms > STAMP_SLACK_MS else []
    session = claimed.session
    if back or keep:
        with wrap_driver_errors("giving back outbox rows the broker did not take"):
            session.connection().execute(statements.unstamp, {
                "ids": back, "keep": keep, "done": now_ms, "stamped": claimed.stamped_at_ms,
                "scope": counters.RELAY, "stripe": claimed.stripe}).one()
    m = mark_rows(session, now_ms, config, published=(), failed=failed, dead_now=dead_now, held=held,
                  held_until_ms=held_until_ms)
    dues = [due for due in (m.rescheduled_ms, claimed.result.next_due_ms) if due is not None]
    return Marked(marked=len(published), failed=m.failed, dead_lettered=m.dead_lettered,
                  next_due_ms=min(dues) if dues else None, next_due_read=True)


def start_publish(publisher: Publisher, messages: Sequence[TaskMessage]) -> Callable[[], PublishReport]:
    """Put ``messages`` on the wire and return the call that waits for the broker's answer.

    A publisher with ``send_batch`` (``SendsAhead``: the Kombu publisher) returns before the
    confirms arrive, so the caller can do database work while the broker works; any other
    publisher publishes and confirms here and the returned call just hands the report back.
    """
    if isinstance(publisher, SendsAhead):
        return publisher.send_batch(messages)
    report = publisher.publish_batch(messages)
    return lambda: report


@dataclass(kw_only=True)
class Claimed:
    """A claimed and built batch, not yet published. On Postgres ``session`` holds the row locks
    (``FOR UPDATE SKIP LOCKED``) until the batch is marked and committed, or rolled back."""

    session: Session
    rows: list[ClaimedRow]
    built: Built
    spans: tracing.RelaySpans
    result: BatchResult
    limit: int
    recheck_ms: int = 0  # held rows are due again this long after the batch is marked
    # Postgres: the claim stamped its rows published at this time (``queries.claim_mark_pg``; None: not
    # stamped, the batch is marked after its confirm) and counted them on the counter row ``stripe``.
    stamped_at_ms: int | None = None
    stripe: str | None = None


@dataclass(kw_only=True)
class InFlight:
    """A batch on the wire: ``wait`` returns the broker's answer (or raises BrokerUnavailableError)."""

    claimed: Claimed
    wait: Callable[[], PublishReport]


_EMPTY = Built(rows=(), messages=(), owners=(), unpublishable={})


def _abort(session: Session, spans: tracing.RelaySpans, e: BaseException) -> None:
    spans.fail("error", e.__class__.__name__)
    try:
        session.rollback()
    except Exception:  # the connection may be gone; the original error matters more
        log.debug("rollback after a failed batch failed", exc_info=True)


def claim_batch(session: Session, clock: Clock, config: RelayConfig, *, limit: int,
                registry_cache: RegistryCache | None = None, read_next_due: bool = False,
                stamp: bool = True) -> Claimed:
    """Claim up to ``limit`` due rows (earliest due first, then seq) and build their broker messages (nothing is sent).

    An empty claim is committed at once. On SQLite the read transaction is committed before
    returning, so the database's one write lock is never held across broker I/O. An exception rolls
    back (releasing the claim) and propagates. With ``config.hold``, task rows no live worker of their
    queue runs are set aside (``Built.held``) and put back for ``hold.recheck_ms`` when the batch is
    marked; ``registry_cache`` spares the registry read while it is fresh (``RegistryCache``). With
    ``read_next_due`` (and ``config.statements``) a claim that comes back empty also reads the next due
    time (``BatchResult.next_due_ms``) in its own transaction, before its commit: the standalone relay
    sleeps until then without a session and a query of its own (relay/loop.py). Only valid when no batch
    of the same relay is in flight (its rows still look pending): the loop asks for it on a drain's first claim.

    With ``stamp`` (and ``config.statements.claim_mark_sql``: Postgres through a libpq driver), the claim also
    stamps its rows published, counts them and reads the next due time, empty or not (``claimed_and_stamped``;
    ``finish_batch`` then only commits, or gives back what the broker did not take). Only for a batch sent
    right after its claim with no batch of the same relay in flight: its stamp is its send time within
    ``STAMP_SLACK_MS`` and its next due time is what the relay sleeps for. Otherwise rows are marked after
    their confirm.
    """
    tables, routes, namespace, hold, statements = (config.tables, config.routes, config.namespace, config.hold,
                                                   config.statements)
    result = BatchResult()
    spans = tracing.NO_RELAY_SPANS
    try:
        now = clock.now_ms()
        stamped_sql = _driver_sql(session.connection(), statements.claim_mark_sql) \
            if stamp and statements is not None and statements.claim_mark_sql is not None else None
        stripe: str | None = None
        try:
            if stamped_sql is not None:
                rows, due, stripe = claimed_and_stamped(
                    session, stamped_sql, now, limit, prepared=statements.claim_mark_prepared if statements else None)
                result.next_due_ms, result.next_due_read = due, True
            else:
                rows = claim_due(session, now, limit, tables=tables, statements=statements)
        except UNDECODABLE:  # a due row's stored JSON the driver cannot decode (relay/undecodable.py)
            session.rollback()
            result.dead_lettered = result.claimed = dead_letter_undecodable(session, now, limit, tables=tables)
            if not result.dead_lettered:
                raise
            log.warning("dead-lettered %s due row(s) whose stored JSON cannot be decoded", result.dead_lettered)
            return Claimed(session=session, rows=[], built=_EMPTY, spans=spans, result=result, limit=limit)
        result.claimed = len(rows)
        held = held_rows(session, rows, now, hold=hold, tables=tables, cache=registry_cache) if rows else {}
        if not rows and read_next_due and statements is not None and not result.next_due_read:
            with wrap_driver_errors("reading the next due time"):
                due = session.connection().execute(statements.next_due).scalar()
            result.next_due_ms, result.next_due_read = None if due is None else int(due), True
        if not rows or not is_postgres(session):
            session.commit()  # SQLite: single relay; do not hold the write lock across broker I/O
        if not rows:
            return Claimed(session=session, rows=rows, built=_EMPTY, spans=spans, result=result, limit=limit)
        spans = tracing.relay_spans(rows, routes=routes, namespace=namespace)  # one span per row if configured
        built = spans.build(rows, lambda rs: build_messages(rs, routes=routes, namespace=namespace,
                                                           max_message_bytes=config.max_message_bytes, held=held))
        return Claimed(session=session, rows=rows, built=built, spans=spans, result=result, limit=limit,
                       recheck_ms=0 if hold is None else hold.recheck_ms,
                       stamped_at_ms=now if stamped_sql is not None else None, stripe=stripe)
    except BaseException as e:
        _abort(session, spans, e)
        raise


def _broker_down(claimed: Claimed, e: BrokerUnavailableError, clock: Clock, config: RelayConfig, *,
                 breaker: CircuitBreaker | None) -> BatchResult:
    """Leave every row of the batch as it was (pending, no attempt charged) and trip the breaker."""
    session, result = claimed.session, claimed.result
    session.rollback()
    result.next_due_ms, result.next_due_read = None, False  # a stamped claim's reading left its own rows out
    result.broker_unavailable = True
    result.error = str(e)
    result.duplicates_risked = len(claimed.rows) - len(claimed.built.unpublishable)
    if breaker is not None:
        breaker.record_failure(clock.now_ms(), str(e))
    log.warning("broker unavailable, %s row(s) left pending: %s", result.duplicates_risked, e)
    claimed.spans.fail("broker_unavailable", str(e))
    counters.increment(session, counters.RELAY, counters.BROKER_UNAVAILABLE, tables=config.tables)
    return result


def send_claimed(claimed: Claimed, publisher: Publisher, clock: Clock, config: RelayConfig, *,
                 breaker: CircuitBreaker | None = None,
                 crash_points: CrashPointsLike | None = None) -> InFlight | BatchResult:
    """Put a claimed batch on the wire. Returns the ``InFlight`` batch, or the finished
    ``BatchResult`` when the broker could not be reached (every row left pending)."""
    try:
        if crash_points is not None:
            crash_points.reached("after_claim_before_publish")
        messages = claimed.built.messages
        if not messages:
            empty = PublishReport(count=0)
            return InFlight(claimed=claimed, wait=lambda: empty)
        try:
            wait = start_publish(publisher, messages)
        except BrokerUnavailableError as e:
            return _broker_down(claimed, e, clock, config, breaker=breaker)
        return InFlight(claimed=claimed, wait=wait)
    except BaseException as e:
        _abort(claimed.session, claimed.spans, e)
        raise


def finish_batch(flight: InFlight, clock: Clock, config: RelayConfig, *, breaker: CircuitBreaker | None = None,
                 crash_points: CrashPointsLike | None = None) -> BatchResult:
    """Wait for the broker's answer, THEN mark the rows and commit (publish first, mark after)."""
    claimed = flight.claimed
    session, rows, built, spans, result = claimed.session, claimed.rows, claimed.built, claimed.spans, claimed.result
    try:
        try:
            report = flight.wait()
        except BrokerUnavailableError as e:
            return _broker_down(claimed, e, clock, config, breaker=breaker)
        rejected_rows: dict[int, tuple[ClaimedRow, str]] = {}
        for index, error in report.rejected.items():
            owner = built.owners[index]
            if owner not in rejected_rows:
                rejected_rows[owner] = (rows[owner], f"{built.messages[index].consumer}: {error}")
        result.messages_sent = report.count - len(report.rejected)
        if breaker is not None:
            breaker.record_success()
        if crash_points is not None:
            crash_points.reached("after_publish_before_mark")
        done = clock.now_ms()
        published = [r for i, r in enumerate(rows)
                     if i not in built.unpublishable and i not in rejected_rows and i not in built.held]
        dead_now = {i: (rows[i], why) for i, why in built.unpublishable.items()}
        held = [(rows[i], f"waiting for a worker that runs {why}") for i, why in built.held.items()]
        if claimed.stamped_at_ms is None:
            m = mark_rows(session, done, config, published=published, failed=rejected_rows, dead_now=dead_now,
                          count=True, held=held, held_until_ms=done + claimed.recheck_ms)
        else:
            m = settle_stamped(claimed, done, config, published=published, failed=rejected_rows, dead_now=dead_now,
                               held=held, held_until_ms=done + claimed.recheck_ms)
        marked, result.failed, result.dead_lettered = m.marked, m.failed, m.dead_lettered
        result.next_due_ms, result.next_due_read = m.next_due_ms, m.next_due_read
        result.held = len(held)
        if held:
            log.info("%s task row(s) held: %s", len(held), "; ".join(sorted({why for _, why in held}))[:500])
        with wrap_driver_errors("counting the relay batch"):
            counters.stage_increment(session, counters.RELAY, counters.PUBLISH_FAILURES, len(rejected_rows),
                                     tables=config.tables)
            counters.stage_increment(session, counters.RELAY, counters.DEAD_LETTERED, result.dead_lettered,
                                     tables=config.tables)
        with wrap_driver_errors("committing the relay batch"):
            session.commit()
        # a held row's span ends "failed" with what it waits for (no attempt was charged)
        spans.finish(rejected={**rejected_rows, **{i: (rows[i], f"held: {why}") for i, why in built.held.items()}},
                     dead_now=dead_now, max_attempts=config.max_attempts)
        result.dead_lettered_rows = [(str(r.message_id), why) for r, why in dead_now.values()] + [
            (str(r.message_id), why) for r, why in rejected_rows.values() if r.attempts + 1 >= config.max_attempts]
        result.published = marked
        result.already_published = len(published) - marked
        if result.already_published:
            log.warning("%s row(s) were published by another relay too (duplicates)", result.already_published)
        if crash_points is not None:
            crash_points.reached("after_mark")
        return result
    except BaseException as e:
        _abort(session, spans, e)
        raise


def dispatch_batch(session: Session, publisher: Publisher, clock: Clock, *, tables: Tables, batch_size: int,
                   max_attempts: int, base_delay_ms: int, max_delay_ms: int,
                   routes: Mapping[str, Sequence[str]], max_message_bytes: int, namespace: str = "outbox",
                   breaker: CircuitBreaker | None = None, crash_points: CrashPointsLike | None = None,
                   hold: DeployHold | None = None) -> BatchResult:
    """``dispatch`` with its ``RelayConfig`` built from these keywords (one-off callers and tests)."""
    config = RelayConfig(tables=tables, routes=routes, namespace=namespace, max_message_bytes=max_message_bytes,
                         max_attempts=max_attempts, base_delay_ms=base_delay_ms, max_delay_ms=max_delay_ms, hold=hold)
    return dispatch(session, publisher, clock, config, batch_size=batch_size, breaker=breaker, crash_points=crash_points)


def dispatch(session: Session, publisher: Publisher, clock: Clock, config: RelayConfig, *, batch_size: int,
             breaker: CircuitBreaker | None = None, crash_points: CrashPointsLike | None = None) -> BatchResult:
    """Claim up to ``batch_size`` due rows (earliest due first, then seq), publish them, then mark them in one commit.

    A broker outage (``BrokerUnavailableError``) leaves every row as it was, trips ``breaker`` and returns
    ``broker_unavailable=True``; it is never charged to a row. Any other exception rolls back (on
    Postgres releasing the claim) and propagates. The pipelined relay (relay/loop.py) runs the same
    three steps (``claim_batch``, ``send_claimed``, ``finish_batch``), overlapped across batches.
    """
    now = clock.now_ms()
    if breaker is not None and not breaker.allow(now):
        return BatchResult(broker_unavailable=True, breaker_open=True, error=breaker.last_error)
    limit = breaker.batch_limit(now, batch_size) if breaker is not None else batch_size
    claimed = claim_batch(session, clock, config, limit=limit)
    if not claimed.rows:
        return claimed.result
    flight = send_claimed(claimed, publisher, clock, config, breaker=breaker, crash_points=crash_points)
    if isinstance(flight, BatchResult):
        return flight
    return finish_batch(flight, clock, config, breaker=breaker, crash_points=crash_points)


def dispatch_with_settings(session: Session, publisher: Publisher, clock: Clock, settings: Settings, *,
                           tables: Tables, breaker: CircuitBreaker | None = None, crash_points: CrashPointsLike | None = None,
                           batch_size: int | None = None,
                           routes: Mapping[str, Sequence[str]] | None = None) -> BatchResult:
    """``dispatch`` with every knob taken from ``settings``."""
    return dispatch(session, publisher, clock, RelayConfig.from_settings(settings, tables=tables, routes=routes),
                    batch_size=batch_size or settings.relay_batch_size, breaker=breaker, crash_points=crash_points)


def hold_from_settings(settings: Settings) -> DeployHold | None:
    """The deploy hold the settings ask for: None when workers do not register (heartbeat 0)."""
    if not settings.worker_heartbeat_ms:
        return None
    return DeployHold(heartbeat_ms=settings.worker_heartbeat_ms, recheck_ms=settings.relay_hold_recheck_ms)


def breaker_from_settings(settings: Settings) -> CircuitBreaker:
    return CircuitBreaker(base_ms=settings.relay_breaker_base_ms, max_ms=settings.relay_breaker_max_ms)
