"""The reconciler: publish again what was published and never reached the other side.

The outbox says what was published; the inbox (and, for plain tasks, the task receipts) what each
consumer or task committed, so together they see a message lost anywhere between the two: a broker
that lost acknowledged data, kombu's Redis transport dropping a message popped by a worker (or from
a Redis server) that died before recording it as unacked (docs/guarantees.md). Three kinds of row:

* an event: a (message, consumer) pair with no inbox row, no dead letter and no parked copy is
  published again to that consumer only; the inbox absorbs it if it was merely slow;
* an ``@outbox.task`` (its name in ``idempotent_tasks``): with no inbox row under its task key
  (``inbox.task_keys.task_key``) and no dead letter of its task id, the stored task message is
  published again with the SAME task id (``messages.task_row_message``, as the relay sent it), so the
  inbox absorbs it if it did run;
* a plain task captured by ``.delay()`` (any other task row whose message asks for a receipt,
  ``inbox.receipts``): with no receipt, no inbox row and no dead letter it is published again the
  same way. It has no inbox, so a re-send of a task that was merely still queued runs it twice: these
  rows have their own, longer window (``plain_older_than_ms``, never shorter than ``older_than_ms``;
  0 turns it off).

Each kind is checked once, in a window that ends ``older_than_ms`` (plain tasks:
``plain_older_than_ms``) ago and starts where the previous pass stopped: a keyset watermark
(published_at_ms, seq) per window, kept in ``outbox_counters``, so every published row is checked
once, late enough that a healthy consumer has long handled it. A pass pages through its window until
it is caught up (at most ``max_pages`` pages), committing the watermark after each page. What it
sends is counted in ``outbox_counters`` (``reconciled`` and one counter per kind) and logged.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox import counters
from celery_outbox.clock import Clock
from celery_outbox.db import wrap_driver_errors
from celery_outbox.errors import (
    BrokerUnavailableError,
    MalformedMessageError,
    MessageTooLargeError,
    SerializationError,
)
from celery_outbox.inbox.receipts import wants_receipt
from celery_outbox.inbox.task_keys import task_key
from celery_outbox.messages import Envelope, TaskMessage, celery_task_messages, is_task_row, task_row_message
from celery_outbox.relay.publisher import Publisher
from celery_outbox.schema import Tables
from celery_outbox.sql import insert_for

log = logging.getLogger("celery_outbox.relay.reconcile")

WATERMARK = "reconciled_through_ms"
WATERMARK_SEQ = "reconciled_through_seq"  # with the ms: a keyset, so rows sharing one ms are never skipped
PLAIN_WATERMARK = "reconciled_plain_through_ms"
PLAIN_WATERMARK_SEQ = "reconciled_plain_through_seq"
KINDS = {"event": counters.RECONCILED_EVENTS, "task": counters.RECONCILED_TASKS,
         "plain_task": counters.RECONCILED_PLAIN_TASKS}
_ALL = 2**63 - 1


@dataclass(frozen=True, kw_only=True)
class Resent:
    """One message a pass published again: its kind, outbox message id and target (consumer or task)."""

    kind: str  # "event" | "task" | "plain_task"
    message_id: str
    target: str


@dataclass(kw_only=True)
class ReconcileResult:
    checked: int = 0  # published rows looked at in the events + @outbox.task window
    plain_checked: int = 0  # published rows looked at in the plain-task window
    republished: int = 0  # messages sent again, all kinds
    events: int = 0  # (event, consumer) pairs sent again
    tasks: int = 0  # @outbox.task messages sent again
    plain_tasks: int = 0  # plain task messages sent again
    pages: int = 0
    watermark_ms: int = 0
    plain_watermark_ms: int | None = None  # None: the plain-task window is off
    broker_unavailable: bool = False
    resent: list[Resent] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The pass as a task result shows it (Flower): counts, not the list of messages."""
        return {"checked": self.checked, "plain_checked": self.plain_checked, "republished": self.republished,
                "events": self.events, "tasks": self.tasks, "plain_tasks": self.plain_tasks, "pages": self.pages,
                "watermark_ms": self.watermark_ms, "plain_watermark_ms": self.plain_watermark_ms,
                "broker_unavailable": self.broker_unavailable}


@dataclass(frozen=True, kw_only=True)
class _Window:
    """One watermark and the rows it covers: events + @outbox.task rows, or plain task rows."""

    plain: bool
    mark_ms: str
    mark_seq: str
    older_than_ms: int


def _watermark(session: Session, window: _Window, *, tables: Tables) -> tuple[int, int] | None:
    """(published_at_ms, seq) checked through; a watermark without its seq covers that whole ms.
    Both counters in one read (a pass runs every few seconds, found something or not), locked on Postgres
    until the caller's transaction ends: a concurrent pass waits, then reads what this one wrote."""
    c = tables.counters
    found = {name: int(value) for name, value in session.execute(
        sa.select(c.name, c.value).where(c.consumer == counters.RELAY, c.name.in_((window.mark_ms, window.mark_seq)))
        .with_for_update())}
    ms = found.get(window.mark_ms)
    if ms is None:
        return None
    return ms, found.get(window.mark_seq, _ALL)


def _set_watermark(session: Session, window: _Window, value: tuple[int, int], *, tables: Tables) -> None:
    """Both counters in one upsert (the caller commits)."""
    stmt = insert_for(session, tables.counters).values(
        [{"consumer": counters.RELAY, "name": window.mark_ms, "value": value[0]},
         {"consumer": counters.RELAY, "name": window.mark_seq, "value": value[1]}])
    session.execute(stmt.on_conflict_do_update(index_elements=["consumer", "name"],
                                               set_={"value": stmt.excluded.value}))


def _forget_watermark(session: Session, window: _Window, *, tables: Tables) -> bool:
    """A window turned off: turned on again later it starts afresh instead of re-checking its gap.
    True when there was a watermark to forget."""
    done = session.execute(sa.delete(tables.counters).where(
        tables.counters.consumer == counters.RELAY, tables.counters.name.in_((window.mark_ms, window.mark_seq))))
    return bool(getattr(done, "rowcount", 0))


@dataclass(frozen=True, kw_only=True)
class _Plan:
    """What one page sends again: the messages and, per message, its kind and target."""

    messages: list[TaskMessage]
    resent: list[Resent]


def _page(session: Session, window: _Window, since: tuple[int, int], upto: int, *, tables: Tables,
          routes: Mapping[str, Sequence[str]], idempotent_tasks: Collection[str], namespace: str,
          max_message_bytes: int, limit: int) -> tuple[int, tuple[int, int], _Plan]:
    """Read one page of ``window`` after ``since``; (rows checked, the next watermark, what to send)."""
    since_ms, since_seq = since
    o = tables.outbox
    published = o.published_at_ms
    rows = session.execute(
        sa.select(o.seq, o.message_id, o.type, o.headers, o.created_at_ms, published)
        # The redundant ``published >= since_ms`` bounds the index scan on ix_<prefix>published from
        # below; without it Postgres walks every row published before the watermark (the OR is a filter).
        .where(published.is_not(None), published <= upto, published >= since_ms,
               sa.or_(published > since_ms, sa.and_(published == since_ms, o.seq > since_seq)))
        .order_by(published, o.seq).limit(limit)
    ).all()
    # A full page means more rows in the window: stop at the last (ms, seq) checked, never inside a ms.
    next_mark = (int(rows[-1].published_at_ms), int(rows[-1].seq)) if len(rows) == limit else (upto, _ALL)
    candidates = []
    for r in rows:
        if not is_task_row(r.headers) or r.type in idempotent_tasks:  # an event or an @outbox.task
            if not window.plain:
                candidates.append(r)
        elif window.plain and wants_receipt((r.headers or {}).get("task_headers")):  # a plain task
            candidates.append(r)
    if not candidates:
        return len(rows), next_mark, _Plan(messages=[], resent=[])
    ids = [r.message_id for r in candidates]
    seen = {(m, c) for m, c in session.execute(sa.select(tables.inbox.message_id, tables.inbox.consumer)
                                               .where(tables.inbox.message_id.in_(ids)))}
    seen |= {(m, c) for m, c in session.execute(sa.select(tables.parked.message_id, tables.parked.consumer)
                                                .where(tables.parked.message_id.in_(ids)))}
    dead = {(m, c) for m, c in session.execute(
        sa.select(tables.dead_letters.message_id, tables.dead_letters.consumer)
        .where(tables.dead_letters.message_id.in_([str(i) for i in ids])))}
    dead_ids = {m for m, _ in dead}
    received: set[uuid.UUID] = set()
    if window.plain:
        received = set(session.execute(sa.select(tables.receipts.task_id)
                                       .where(tables.receipts.task_id.in_(ids))).scalars())
    lost: list[tuple[Any, list[str]]] = []  # (row, missing consumers; [] for a task)
    for r in candidates:
        if is_task_row(r.headers):
            # A dead letter of this task id under any key (the task's, a poison gate's) is a person's job.
            if (r.message_id, task_key(r.type)) in seen or str(r.message_id) in dead_ids or r.message_id in received:
                continue
            lost.append((r, []))
        else:
            missing = [c for c in routes.get(r.type, ()) if (r.message_id, c) not in seen
                       and (str(r.message_id), c) not in dead]
            if missing:
                lost.append((r, missing))
    if not lost:
        return len(rows), next_mark, _Plan(messages=[], resent=[])
    payloads: dict[int, Any] = {seq: payload for seq, payload in session.execute(
        sa.select(o.seq, o.payload).where(o.seq.in_([r.seq for r, _ in lost])))}
    plan = _Plan(messages=[], resent=[])
    for r, missing in lost:
        headers = dict(r.headers or {})
        try:
            if not missing:
                plan.messages.append(task_row_message(message_id=r.message_id, type=r.type, payload=payloads[r.seq],
                                                      headers=headers, max_bytes=max_message_bytes))
                plan.resent.append(Resent(kind="plain_task" if window.plain else "task", message_id=str(r.message_id),
                                          target=r.type))
                continue
            envelope = Envelope(message_id=r.message_id, type=r.type, payload=payloads[r.seq], headers=headers,
                                created_at_ms=r.created_at_ms)
            plan.messages.extend(celery_task_messages(envelope, targets=[(c, f"{namespace}.{c}") for c in missing],
                                                      max_bytes=max_message_bytes))
            plan.resent.extend(Resent(kind="event", message_id=str(r.message_id), target=c) for c in missing)
        except (SerializationError, MessageTooLargeError, MalformedMessageError) as e:  # the relay sent it: unlikely
            log.warning("reconcile: cannot rebuild %s: %s", r.message_id, e)
    return len(rows), next_mark, plan


def reconcile(session: Session, publisher: Publisher, clock: Clock, *, tables: Tables, routes: Mapping[str, Sequence[str]],
              namespace: str, max_message_bytes: int, older_than_ms: int, idempotent_tasks: Collection[str] = (),
              plain_older_than_ms: int = 0, limit: int = 1000, max_pages: int = 100) -> ReconcileResult:
    """One pass over both windows; commits after every page. The first pass of a window only sets its
    watermark (history is not re-checked). ``idempotent_tasks``: the ``@outbox.task`` names this app
    defines (the relay passes them as it passes ``routes``); ``plain_older_than_ms`` 0: plain tasks off."""
    now = clock.now_ms()
    result = ReconcileResult(watermark_ms=now - older_than_ms)
    windows = [_Window(plain=False, mark_ms=WATERMARK, mark_seq=WATERMARK_SEQ, older_than_ms=older_than_ms)]
    plain = _Window(plain=True, mark_ms=PLAIN_WATERMARK, mark_seq=PLAIN_WATERMARK_SEQ,
                    older_than_ms=plain_older_than_ms)
    if plain_older_than_ms > 0:
        plain = replace(plain, older_than_ms=max(plain_older_than_ms, older_than_ms))  # never before the events'
        windows.append(plain)
        result.plain_watermark_ms = now - plain.older_than_ms
    else:
        with wrap_driver_errors("turning off the plain-task reconcile window"):
            forgot = _forget_watermark(session, plain, tables=tables)
            session.commit()
        if forgot:  # once when it is turned off; on every pass when another process still has it on
            log.warning("plain-task reconcile is off here (OUTBOX_RELAY_RECONCILE_PLAIN_TASKS_AFTER_MS=0): its "
                        "watermark was reset. If another relay or beat still has it on, each of its passes now "
                        "starts afresh and lost plain tasks are never sent again: set the same value everywhere")
    for window in windows:
        if not _run_window(session, publisher, window, now - window.older_than_ms, result, tables=tables,
                           routes=routes, idempotent_tasks=frozenset(idempotent_tasks), namespace=namespace,
                           max_message_bytes=max_message_bytes, limit=limit, max_pages=max_pages):
            break
    return result


def _run_window(session: Session, publisher: Publisher, window: _Window, upto: int, result: ReconcileResult, *,
                tables: Tables, routes: Mapping[str, Sequence[str]], idempotent_tasks: Collection[str],
                namespace: str, max_message_bytes: int, limit: int, max_pages: int) -> bool:
    """Page through ``window`` up to ``upto``; False when the broker was unavailable (stop the pass).

    The watermark only moves forward. Two passes can disagree on ``upto`` (a clock ahead or behind on
    another host, a pass that overran its lease): one whose window ends before the watermark does nothing,
    and the write re-reads the watermark under its lock when the lock was let go for a publish. A watermark
    moved back would check a span again and send its lost messages a second time while the first re-send
    may still be queued (a plain task has no inbox to absorb it)."""
    for _ in range(max_pages):
        with wrap_driver_errors("reconciling the outbox with the inbox"):
            since = _watermark(session, window, tables=tables)
            if since is None:
                _set_watermark(session, window, (upto, _ALL), tables=tables)
                session.commit()
                return True
            if since >= (upto, _ALL):  # another pass checked past this window's end
                session.rollback()
                return True
            checked, next_mark, plan = _page(session, window, since, upto, tables=tables, routes=routes,
                                             idempotent_tasks=idempotent_tasks, namespace=namespace,
                                             max_message_bytes=max_message_bytes, limit=limit)
            if plan.messages:
                session.rollback()  # hold no locks across the publish
        result.pages += 1
        if window.plain:
            result.plain_checked += checked
        else:
            result.checked += checked
        if plan.messages:
            try:
                publisher.publish_batch(plan.messages)
            except BrokerUnavailableError as e:
                log.warning("reconcile: broker unavailable, will retry the same window: %s", e)
                result.broker_unavailable = True
                return False
            for sent in plan.resent:
                log.warning("reconcile: %s %s never reached %s; published again", sent.kind.replace("_", " "),
                            sent.message_id, sent.target)
        per_kind = {kind: sum(1 for s in plan.resent if s.kind == kind) for kind in KINDS}
        with wrap_driver_errors("advancing the reconcile watermark"):
            # Nothing sent: still in the transaction that read (and locked) ``since``, and next_mark > since.
            current = _watermark(session, window, tables=tables) if plan.messages else since
            if current is None or current < next_mark:
                _set_watermark(session, window, next_mark, tables=tables)
            counters.stage_increment(session, counters.RELAY, counters.RECONCILED, len(plan.messages), tables=tables)
            for kind, n in per_kind.items():
                counters.stage_increment(session, counters.RELAY, KINDS[kind], n, tables=tables)
            session.commit()
        result.republished += len(plan.messages)
        result.events += per_kind["event"]
        result.tasks += per_kind["task"]
        result.plain_tasks += per_kind["plain_task"]
        result.resent.extend(plan.resent)
        if window.plain:
            result.plain_watermark_ms = next_mark[0]
        else:
            result.watermark_ms = next_mark[0]
        if next_mark[1] == _ALL:  # caught up with the window
            return True
    return True
