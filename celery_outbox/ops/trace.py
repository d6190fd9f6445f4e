"""One message's story, read from the tables: ``outbox trace <message_id | key>``.

The on-call question "where is order 42's message?" is answered from what the database already holds:
the outbox row (committed, publish attempts so far, published or dead-lettered), and per consumer or
task the inbox row (effect committed), the failed-delivery count (``outbox_attempts``), a parked copy
(per-entity ordering), dead letters and their replays, and for a plain task the worker's receipt
(``outbox_task_receipts``). Hop latencies are differences of those instants.

What the tables do not hold, and this view therefore cannot show (``MessageTrace.not_recorded``):
the time and error of each publish attempt but the last (the row keeps the count, the last error and
the next due time), which re-sends the reconciler made (it counts them, per kind, not per message),
how many duplicates a consumer absorbed for this message (counted per consumer), and anything about
a message whose outbox row retention has pruned other than its inbox rows and dead letters.

A key that is not a message id is matched against the ``entity_key`` and ``correlation_id`` headers of
outbox rows: no index serves that (the headers are JSON), so it reads the outbox table once, newest
first, and stops at ``limit`` messages (docs/operations.md, "One message's story", states the measured cost).
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.orm import Session, defer

from celery_outbox.config.masking import mask_secrets
from celery_outbox.db import wrap_driver_errors
from celery_outbox.errors import NotFoundError, ValidationError
from celery_outbox.inbox.receipts import wants_receipt
from celery_outbox.inbox.task_keys import task_key
from celery_outbox.messages import is_task_row
from celery_outbox.schema import OutboxRow, Tables

Kind = Literal["event", "task", "plain_task", "unknown"]
DEFAULT_LIMIT = 20
KEY_MAX_CHARS = 200
NOT_RECORDED = (
    "the time and error of each publish attempt but the last (the row keeps the count, the last error and "
    "the next due time)",
    "re-sends by the reconciler (counted per kind in 'outbox stats', not per message)",
    "duplicates absorbed for this message (counted per consumer in 'outbox stats')",
)


@dataclass(frozen=True, kw_only=True)
class DeadLetterSeen:
    id: str
    dead_lettered_at_ms: int
    deliveries: int
    error: str
    replayed_at_ms: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "dead_lettered_at_ms": self.dead_lettered_at_ms, "deliveries": self.deliveries,
                "error": self.error, "replayed_at_ms": self.replayed_at_ms}


@dataclass(frozen=True, kw_only=True)
class Hop:
    """One consumer (or task) of the message: what it did with it."""

    name: str  # the consumer, the task's inbox key (task:<name>), or the plain task's name
    kind: Literal["consumer", "task", "plain_task"]
    state: str  # processed | received | failing | dead-lettered | parked | not seen yet
    processed_at_ms: int | None = None  # inbox row committed with the effect (plain task: receipt)
    latency_ms: int | None = None  # from published to processed
    failed_deliveries: int = 0
    first_failed_at_ms: int | None = None
    last_error: str | None = None
    parked_at_ms: int | None = None
    dead_letters: list[DeadLetterSeen] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "state": self.state, "processed_at_ms": self.processed_at_ms,
                "latency_ms": self.latency_ms, "failed_deliveries": self.failed_deliveries,
                "first_failed_at_ms": self.first_failed_at_ms, "last_error": self.last_error,
                "parked_at_ms": self.parked_at_ms, "dead_letters": [d.to_dict() for d in self.dead_letters]}


@dataclass(frozen=True, kw_only=True)
class MessageTrace:
    message_id: str
    kind: Kind
    type: str | None
    state: str  # pending | retrying | published | dead-lettered | pruned (no outbox row any more)
    seq: int | None = None
    entity_key: str | None = None
    correlation_id: str | None = None
    created_at_ms: int | None = None  # committed with the caller's transaction
    published_at_ms: int | None = None
    publish_latency_ms: int | None = None
    publish_attempts_failed: int = 0
    next_attempt_at_ms: int | None = None
    last_publish_error: str | None = None
    dead_lettered_at_ms: int | None = None
    hops: list[Hop] = field(default_factory=list)
    not_recorded: tuple[str, ...] = NOT_RECORDED

    def to_dict(self) -> dict[str, Any]:
        return {
            "message_id": self.message_id, "kind": self.kind, "type": self.type, "state": self.state, "seq": self.seq,
            "entity_key": self.entity_key, "correlation_id": self.correlation_id,
            "created_at_ms": self.created_at_ms, "published_at_ms": self.published_at_ms,
            "publish_latency_ms": self.publish_latency_ms, "publish_attempts_failed": self.publish_attempts_failed,
            "next_attempt_at_ms": self.next_attempt_at_ms, "last_publish_error": self.last_publish_error,
            "dead_lettered_at_ms": self.dead_lettered_at_ms, "hops": [h.to_dict() for h in self.hops],
            "not_recorded": list(self.not_recorded),
        }


def _as_uuid(raw: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(raw)
    except ValueError:
        return None


def check_key(raw: object) -> str:
    """A message id or a key: printable text, at most ``KEY_MAX_CHARS``; anything else is refused."""
    if not isinstance(raw, str) or not raw.strip() or len(raw) > KEY_MAX_CHARS or not raw.isprintable():
        shown = repr(raw)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise ValidationError(f"{shown} is not a message id or key; give a message id (UUID), an entity key "
                              f"such as order:42, or a correlation id (printable, at most {KEY_MAX_CHARS} characters)")
    return raw.strip()


def _rows_for(session: Session, key: str, *, tables: Tables, limit: int) -> tuple[list[OutboxRow], list[str]]:
    """The outbox rows the key names, and message ids known only from other tables (pruned rows)."""
    o = tables.outbox
    mid = _as_uuid(key)
    if mid is not None:
        row = session.scalar(sa.select(o).options(defer(o.payload)).where(o.message_id == mid))
        return ([row], []) if row is not None else ([], [str(mid)])
    stmt = sa.select(o).options(defer(o.payload)).where(sa.or_(o.headers["entity_key"].as_string() == key,
                                     o.headers["correlation_id"].as_string() == key))
    return list(session.scalars(stmt.order_by(o.seq.desc()).limit(limit)))[::-1], []


def trace(session: Session, key: str, *, tables: Tables, routes: Mapping[str, Sequence[str]],
          idempotent_tasks: Collection[str] = (), limit: int = DEFAULT_LIMIT) -> list[MessageTrace]:
    """Every message the key names (a message id: one; an entity key or correlation id: up to ``limit``,
    oldest first), each with its hops. Raises ``NotFoundError`` when no table knows the key."""
    key = check_key(key)
    with wrap_driver_errors(f"tracing {key!r}"):
        rows, orphans = _rows_for(session, key, tables=tables, limit=limit)
        ids = [r.message_id for r in rows] + [uuid.UUID(m) for m in orphans]
        if not ids:
            raise NotFoundError(f"no outbox message has id, entity_key or correlation_id {key!r}")
        found = _related(session, ids, tables=tables)
    traces = [_trace_row(r, found, routes=routes, idempotent_tasks=idempotent_tasks) for r in rows]
    for m in orphans:
        t = _trace_orphan(m, found)
        if t is not None:
            traces.append(t)
    if not traces:
        raise NotFoundError(f"no table holds message {key}: never written, or pruned with all its inbox rows")
    return traces


@dataclass(frozen=True, kw_only=True)
class _Related:
    inbox: dict[str, dict[str, int]]  # message id -> consumer -> processed_at_ms
    attempts: dict[str, dict[str, tuple[int, int, str]]]  # -> consumer -> (deliveries, first failed, error)
    parked: dict[str, dict[str, int]]
    dead: dict[str, dict[str, list[DeadLetterSeen]]]
    receipts: dict[str, int]


def _related(session: Session, ids: list[uuid.UUID], *, tables: Tables) -> _Related:
    """Everything keyed by these message ids, one query per table (each by its primary key or index)."""
    inbox: dict[str, dict[str, int]] = {}
    for mid, consumer, at in session.execute(sa.select(tables.inbox.message_id, tables.inbox.consumer,
                                                       tables.inbox.processed_at_ms)
                                             .where(tables.inbox.message_id.in_(ids))):
        inbox.setdefault(str(mid), {})[consumer] = int(at)
    attempts: dict[str, dict[str, tuple[int, int, str]]] = {}
    a = tables.attempts
    for mid, consumer, n, first, err in session.execute(
            sa.select(a.message_id, a.consumer, a.deliveries, a.first_failed_at_ms, a.last_error)
            .where(a.message_id.in_(ids))):
        attempts.setdefault(str(mid), {})[consumer] = (int(n), int(first), err)
    parked: dict[str, dict[str, int]] = {}
    for mid, consumer, at in session.execute(sa.select(tables.parked.message_id, tables.parked.consumer,
                                                       tables.parked.parked_at_ms)
                                             .where(tables.parked.message_id.in_(ids))):
        parked.setdefault(str(mid), {})[consumer] = int(at)
    dead: dict[str, dict[str, list[DeadLetterSeen]]] = {}
    d = tables.dead_letters
    for row in session.scalars(sa.select(d).where(d.message_id.in_([str(i) for i in ids])).order_by(d.id)):
        dead.setdefault(str(_as_uuid(row.message_id) or row.message_id), {}).setdefault(row.consumer, []).append(
            DeadLetterSeen(id=f"consumer:{row.id}", dead_lettered_at_ms=row.last_failed_at_ms,
                           deliveries=row.delivery_count, error=mask_secrets(row.last_error),
                           replayed_at_ms=row.replayed_at_ms))
    receipts = {str(tid): int(at) for tid, at in session.execute(
        sa.select(tables.receipts.task_id, tables.receipts.received_at_ms)
        .where(tables.receipts.task_id.in_(ids)))}
    return _Related(inbox=inbox, attempts=attempts, parked=parked, dead=dead, receipts=receipts)


def _hop(name: str, kind: Literal["consumer", "task", "plain_task"], mid: str, found: _Related,
         published_at_ms: int | None) -> Hop:
    processed = found.inbox.get(mid, {}).get(name)
    if kind == "plain_task":
        processed = found.receipts.get(mid)
    att = found.attempts.get(mid, {}).get(name)
    parked = found.parked.get(mid, {}).get(name)
    dead = found.dead.get(mid, {}).get(name, [])
    open_dead = [x for x in dead if x.replayed_at_ms is None]
    if processed is not None:
        state = "received" if kind == "plain_task" else "processed"
    elif open_dead:
        state = "dead-lettered"
    elif parked is not None:
        state = "parked"
    elif att is not None:
        state = "failing"
    elif dead:
        state = "replayed, not processed yet"
    else:
        state = "not seen yet"
    return Hop(name=name, kind=kind, state=state, processed_at_ms=processed,
               latency_ms=None if processed is None or published_at_ms is None else processed - published_at_ms,
               failed_deliveries=att[0] if att else 0, first_failed_at_ms=att[1] if att else None,
               last_error=(mask_secrets(att[2]) or None) if att and att[2] else None, parked_at_ms=parked,
               dead_letters=list(dead))


def _seen_consumers(mid: str, found: _Related) -> list[str]:
    names: dict[str, None] = {}
    for table in (found.inbox, found.attempts, found.parked, found.dead):
        names.update(dict.fromkeys(table.get(mid, {})))
    return list(names)


def _trace_row(row: OutboxRow, found: _Related, *, routes: Mapping[str, Sequence[str]],
               idempotent_tasks: Collection[str]) -> MessageTrace:
    mid = str(row.message_id)
    headers = row.headers if isinstance(row.headers, dict) else {}
    hops: list[Hop] = []
    kind: Kind
    if is_task_row(headers):
        if row.type in idempotent_tasks:
            kind, expected = "task", [(task_key(row.type), "task")]
        elif wants_receipt(headers.get("task_headers")):
            kind, expected = "plain_task", [(row.type, "plain_task")]
        else:
            kind, expected = "plain_task", []
    else:
        kind, expected = "event", [(c, "consumer") for c in routes.get(row.type, ())]
    named = {n for n, _ in expected}
    for name, hop_kind in expected:
        hops.append(_hop(name, hop_kind, mid, found, row.published_at_ms))  # type: ignore[arg-type]
    for name in _seen_consumers(mid, found):  # a consumer no longer routed, or a task's gate dead letter
        if name not in named:
            hops.append(_hop(name, "task" if kind == "task" else "consumer", mid, found, row.published_at_ms))
    if row.dead_lettered_at_ms is not None:
        state = "dead-lettered"
    elif row.published_at_ms is not None:
        state = "published"
    else:
        state = "retrying" if row.attempts else "pending"
    return MessageTrace(
        message_id=mid, kind=kind, type=row.type, state=state, seq=row.seq,
        entity_key=_text(headers.get("entity_key")), correlation_id=_text(headers.get("correlation_id")),
        created_at_ms=row.created_at_ms, published_at_ms=row.published_at_ms,
        publish_latency_ms=None if row.published_at_ms is None else row.published_at_ms - row.created_at_ms,
        publish_attempts_failed=row.attempts,
        next_attempt_at_ms=row.next_attempt_at_ms if row.published_at_ms is None else None,
        last_publish_error=mask_secrets(row.last_error) if row.last_error else None,
        dead_lettered_at_ms=row.dead_lettered_at_ms, hops=hops)


def _trace_orphan(mid: str, found: _Related) -> MessageTrace | None:
    """A message whose outbox row was pruned (or that came from another service): its hops only."""
    names = _seen_consumers(mid, found)
    if not names and mid not in found.receipts:
        return None
    hops = [_hop(n, "consumer", mid, found, None) for n in names]
    if mid in found.receipts:
        hops.append(_hop("(plain task)", "plain_task", mid, found, None))
    return MessageTrace(message_id=mid, kind="unknown", type=None, state="pruned", hops=hops)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
