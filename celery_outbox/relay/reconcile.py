"""The reconciler: publish again what was published and is lost, never what is only late.

The outbox says what was published; the inbox (and, for plain tasks, the task receipts) what each
consumer or task committed, so together they see a message lost anywhere between the two: a broker
that lost acknowledged data, kombu's Redis transport dropping a message popped by a worker (or from
a Redis server) that died before recording it as unacked, an operator's purge (docs/guarantees.md).
Three kinds of row:

* an event: a (message, consumer) pair with no inbox row, no dead letter and no parked copy is
  published again to that consumer only;
* an ``@outbox.task`` (its name in ``idempotent_tasks``): with no inbox row under its task key
  (``inbox.task_keys.task_key``) and no dead letter of its task id, the stored task message is
  published again with the SAME task id (``messages.task_row_message``, as the relay sent it);
* a plain task captured by ``.delay()`` (any other task row whose message asks for a receipt,
  ``inbox.receipts``): with no receipt, no inbox row and no dead letter it is published again the
  same way. It has no inbox, so its floor is longer (``plain_older_than_ms``, never shorter than
  ``older_than_ms``; 0 turns it off).

Not recorded is not lost: a consumer that is behind (a database freeze, a deploy, a peak) has
recorded nothing of its backlog, and re-sending the backlog would add a copy of it to the queue at
the worst moment (docs/design.md, rule 16). So a message older than its floor is re-sent only on evidence:

* **the consumer passed it.** Each pass samples, per target (an event consumer, an ``@outbox.task``
  key, a plain task name), its frontier: the latest publish time among what it recorded. A
  checkpoint (pass time T, frontier F) is proof, once the frontier exceeds T + floor + skew, that
  every message published before F - skew was taken before T (queues are FIFO; ``skew``, the publish
  timeout, covers a batch marked after a later one was sent), and that any copy of it a worker gave
  back (a retry, a killed worker's redelivery, all within the floor, which on Redis exceeds the
  visibility timeout) was queued again before what the consumer has since recorded. The checkpoint
  then moves on and ``horizon`` becomes F - skew. A message with a failed delivery on record
  (``inbox.attempts``) counts from its last failure, when its retry was queued;
* **the broker holds no copy** (relay/queues.py): its queue has nothing waiting and, on Redis, its
  id is not in kombu's unacked hash; on RabbitMQ, which cannot list what consumers hold, the queue
  has no consumer, or has had nothing waiting at every ask for a whole floor.

A message with neither is waiting, whatever its age: its window stops there and it is checked again
on the next pass. Each event consumer has its own window (a keyset watermark (published_at_ms, seq)
in ``outbox_counters``), so a consumer that is behind holds back only its own; ``@outbox.task`` rows
share one window and plain tasks another. A pass pages through each window (at most ``max_pages``
pages); the watermarks and the progress it read are written in one upsert when it commits: once, at its
end, when it sends nothing and no window has more than a page (one transaction), else also before each
publish and after each page. When the broker cannot be asked, only the
consumers' progress counts: logged, counted (``reconcile_probe_failures``), nothing re-sent on age.
What it sends is counted in ``outbox_counters`` (``reconciled`` and one counter per kind) and logged.

One module, though long: the three kinds of row share one pass, one window per consumer and the same two kinds
of evidence; apart, a kind could be re-sent on weaker evidence than the others.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
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
from celery_outbox.relay.queues import QueueInspector, QueueState
from celery_outbox.schema import Tables
from celery_outbox.sql import insert_for

log = logging.getLogger("celery_outbox.relay.reconcile")

# Before each event consumer had its own window, one watermark covered events and @outbox.task rows: a
# window with no watermark of its own starts from it.
WATERMARK = "reconciled_through_ms"
WATERMARK_SEQ = "reconciled_through_seq"  # with the ms: a keyset, so rows sharing one ms are never skipped
TASK_WATERMARK = "reconciled_tasks_through_ms"
TASK_WATERMARK_SEQ = "reconciled_tasks_through_seq"
PLAIN_WATERMARK = "reconciled_plain_through_ms"
PLAIN_WATERMARK_SEQ = "reconciled_plain_through_seq"
SAMPLED = "reconcile_sampled_through_ms"  # progress read from the inbox and the receipts up to here
PROBE_FAILURES = "reconcile_probe_failures"  # passes that could not ask the broker about its queues
KINDS = {"event": counters.RECONCILED_EVENTS, "task": counters.RECONCILED_TASKS,
         "plain_task": counters.RECONCILED_PLAIN_TASKS}
_ALL = 2**63 - 1
_NEVER = -(2**62)


def _digest(text: str) -> str:
    """A counter name fits 64 characters whatever the consumer, task or queue name: its digest."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def event_watermark(consumer: str) -> tuple[str, str]:
    """The counter names of event consumer ``consumer``'s watermark (ms, seq)."""
    d = _digest(f"event:{consumer}")
    return f"rw:{d}:ms", f"rw:{d}:seq"


def _progress_name(target: str, part: str) -> str:
    return f"rp:{_digest(target)}:{part}"


def _quiet_name(queue: str) -> str:
    """Since when the queue has had nothing waiting, at every ask."""
    return f"rq:{_digest(queue)}"


def _quiet_seen_name(queue: str) -> str:
    """When an ask last found it so: asks further apart than half a floor start the wait over (what the
    queue did between them is unknown)."""
    return f"rs:{_digest(queue)}"


def plain_target(name: str) -> str:
    """The progress key of a plain task name (event consumers and task keys are their inbox names)."""
    return f"plain:{name}"


@dataclass(frozen=True, kw_only=True)
class Resent:
    """One message a pass published again: its kind, outbox message id and target (consumer or task)."""

    kind: str  # "event" | "task" | "plain_task"
    message_id: str
    target: str


@dataclass(kw_only=True)
class ReconcileResult:
    checked: int = 0  # published rows looked at in the events + @outbox.task windows
    plain_checked: int = 0  # published rows looked at in the plain-task window
    republished: int = 0  # messages sent again, all kinds
    events: int = 0  # (event, consumer) pairs sent again
    tasks: int = 0  # @outbox.task messages sent again
    plain_tasks: int = 0  # plain task messages sent again
    waiting: int = 0  # windows held at a message not recorded and not proved lost (a consumer behind)
    pages: int = 0
    watermark_ms: int = 0
    plain_watermark_ms: int | None = None  # None: the plain-task window is off
    broker_unavailable: bool = False
    probe_failed: bool = False  # the broker could not be asked about its queues this pass
    resent: list[Resent] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The pass as a task result shows it (Flower): counts, not the list of messages."""
        return {"checked": self.checked, "plain_checked": self.plain_checked, "republished": self.republished,
                "events": self.events, "tasks": self.tasks, "plain_tasks": self.plain_tasks, "pages": self.pages,
                "waiting": self.waiting, "watermark_ms": self.watermark_ms,
                "plain_watermark_ms": self.plain_watermark_ms, "broker_unavailable": self.broker_unavailable,
                "probe_failed": self.probe_failed}


@dataclass(frozen=True, kw_only=True)
class _Window:
    """One watermark and the rows it covers: one consumer's events, @outbox.task rows, or plain task rows."""

    kind: str  # "event" | "task" | "plain_task"
    mark_ms: str
    mark_seq: str
    older_than_ms: int
    consumer: str = ""  # an event window's consumer
    types: frozenset[str] = frozenset()  # event: the types routed to it; task: the @outbox.task names

    @property
    def plain(self) -> bool:
        return self.kind == "plain_task"


@dataclass(kw_only=True)
class _Evidence:
    """What a pass knows beyond the database rows: per target the horizon its progress proved
    (``horizons``, by the target's digest), per queue what the broker said (``states``; None: it could
    not be asked) and since when a RabbitMQ queue with consumers has had nothing waiting (``quiet``, by
    counter name)."""

    now: int
    floor_ms: int
    horizons: dict[str, int]
    quiet: dict[str, int]
    inspector: QueueInspector | None
    states: dict[str, QueueState | None] = field(default_factory=dict)
    probe_failed: bool = False

    def ask(self, queues: Collection[str]) -> None:
        missing = sorted({q for q in queues if q not in self.states})
        if not missing:
            return
        if self.inspector is None:
            self.states.update(dict.fromkeys(missing))
            return
        try:
            found = self.inspector.queue_states(missing)
        except Exception as e:  # a broker that cannot be asked is no evidence, never a failed pass
            if not self.probe_failed:
                log.warning("reconcile: cannot ask the broker what its queues hold (%s); this pass re-sends only "
                            "what the consumers' progress proves lost", e)
            self.probe_failed = True
            self.states.update(dict.fromkeys(missing))
            return
        for q in missing:
            self.states[q] = found.get(q)

    def broker_holds_no_copy(self, queue: str, message_id: str) -> bool:
        state = self.states.get(queue)
        if state is None:
            return False
        answer = state.holds_no_copy_of(message_id)
        if answer is None:  # RabbitMQ with consumers: empty for a whole floor, at asks half a floor apart at most
            since, seen = self.quiet.get(_quiet_name(queue)), self.quiet.get(_quiet_seen_name(queue))
            return (since is not None and seen is not None and since <= self.now - self.floor_ms
                    and seen >= self.now - self.floor_ms // 2)
        return answer


def _read_counters(session: Session, names: Collection[str] = (), *, prefixes: Collection[str] = (),
                   tables: Tables, lock: bool = False) -> dict[str, int]:
    c = tables.counters
    match = [c.name.in_(list(names))] if names else []
    match += [c.name.like(f"{p}%") for p in prefixes]
    stmt = sa.select(c.name, c.value).where(c.consumer == counters.RELAY, sa.or_(*match))
    return {name: int(value) for name, value in session.execute(stmt.with_for_update() if lock else stmt)}


def _write_counters(session: Session, values: Mapping[str, int], *, tables: Tables) -> None:
    """Set counters ``values`` in one upsert (the caller commits)."""
    if not values:
        return
    stmt = insert_for(session, tables.counters).values(
        [{"consumer": counters.RELAY, "name": name, "value": value} for name, value in values.items()])
    session.execute(stmt.on_conflict_do_update(index_elements=["consumer", "name"],
                                               set_={"value": stmt.excluded.value}))


def _marks(window: _Window, value: tuple[int, int]) -> dict[str, int]:
    return {window.mark_ms: value[0], window.mark_seq: value[1]}


@dataclass(kw_only=True)
class _Counters:
    """The counters a pass keeps (watermarks, consumers' progress, queue marks): read in ONE statement, locked on
    Postgres until the pass commits (a concurrent pass waits, then reads what this one wrote), and written in ONE
    upsert at that commit, so a pass that sends nothing is one transaction however many windows it checks. A
    commit (before a publish: no lock held across a broker call; after a full page) lets the locks go; the next
    read takes them again and sees what another pass wrote meanwhile."""

    names: tuple[str, ...]
    stored: dict[str, int] | None = None  # None: not read since the last commit
    pending: dict[str, int] = field(default_factory=dict)
    drop: set[str] = field(default_factory=set)

    def read(self, session: Session, *, tables: Tables) -> dict[str, int]:
        if self.stored is None:
            self.stored = _read_counters(session, self.names, prefixes=("rp:", "rq:", "rs:"), tables=tables,
                                         lock=True)
        return {k: v for k, v in self.stored.items() if k not in self.drop} | self.pending

    def watermark(self, session: Session, window: _Window, *, tables: Tables) -> tuple[int, int] | None:
        """(published_at_ms, seq) checked through; a watermark without its seq covers that whole ms."""
        found = self.read(session, tables=tables)
        ms = found.get(window.mark_ms)
        return None if ms is None else (ms, found.get(window.mark_seq, _ALL))

    def set(self, values: Mapping[str, int]) -> None:
        self.pending.update(values)
        self.drop.difference_update(values)

    def forget(self, names: Collection[str], *, session: Session, tables: Tables) -> bool:
        """Delete ``names`` at the commit; True when one of them is stored."""
        found = [n for n in names if n in self.read(session, tables=tables)]
        for n in names:
            self.pending.pop(n, None)
        self.drop.update(found)
        return bool(found)

    def commit(self, session: Session, *, tables: Tables) -> None:
        _write_counters(session, self.pending, tables=tables)
        if self.drop:
            session.execute(sa.delete(tables.counters).where(tables.counters.consumer == counters.RELAY,
                                                             tables.counters.name.in_(sorted(self.drop))))
        session.commit()
        self.stored, self.pending, self.drop = None, {}, set()


def _sample_progress(session: Session, now: int, held: _Counters, *, tables: Tables, floor_ms: int, skew_ms: int,
                     plain: bool) -> tuple[dict[str, int], dict[str, int]]:
    """Move every target's progress on by what it recorded since the last sample; its proved horizons.

    Per target (progress key): ``F`` its frontier (the latest publish time among what it recorded),
    ``T``/``C`` a checkpoint (pass time, frontier then), ``H`` the horizon: every message published
    before it was taken, and any copy given back queued again, before something the target has since
    recorded (module docstring). Reads only what was recorded since the previous sample (a second more: a
    commit can carry an earlier time; a row missed only holds the frontier back, never forward), through
    ``ix_<prefix>inbox_processed`` and ``ix_<prefix>receipts_at``, the inbox and the receipts in one statement.
    Returns the horizons and the RabbitMQ queues' quiet marks (``_Evidence.quiet``), both from ``held``'s
    read; what moved is written at ``held``'s commit."""
    o, i, r = tables.outbox, tables.inbox, tables.receipts
    with wrap_driver_errors("reading the consumers' progress"):
        stored = held.read(session, tables=tables)
        since = max(stored.get(SAMPLED, now - floor_ms), now - floor_ms) - min(floor_ms // 4, 1_000)
        query: Any = (sa.select(i.consumer.label("target"), sa.func.max(o.published_at_ms)).select_from(i)
                      .join(o, o.message_id == i.message_id)
                      .where(i.processed_at_ms > since).group_by(i.consumer))
        if plain:
            query = sa.union_all(query, sa.select((sa.literal(plain_target("")) + o.type).label("target"),
                                                  sa.func.max(o.published_at_ms)).select_from(r)
                                 .join(o, o.message_id == r.task_id)
                                 .where(r.received_at_ms > since).group_by(o.type))
        latest = {target: int(top) for target, top in session.execute(query) if top is not None}
        changed: dict[str, int] = {SAMPLED: now}
        keys = {name.split(":")[1] for name in stored if name.startswith("rp:")}
        by_key = {_digest(t): t for t in latest}
        horizons: dict[str, int] = {}
        for key in keys | set(by_key):
            def get(part: str, key: str = key) -> int | None:
                return stored.get(f"rp:{key}:{part}")

            frontier = max(get("F") or _NEVER, latest.get(by_key.get(key, ""), _NEVER))
            at, checkpoint, horizon = get("T"), get("C"), get("H")
            if frontier == _NEVER:
                continue
            if at is None or checkpoint is None:
                at, checkpoint = now, frontier
            elif frontier > at + floor_ms + skew_ms:  # recorded something queued after every give-back
                horizon = max(horizon if horizon is not None else _NEVER, checkpoint - skew_ms)
                at, checkpoint = now, frontier
            for part, value in (("F", frontier), ("T", at), ("C", checkpoint), ("H", horizon)):
                if value is not None and stored.get(f"rp:{key}:{part}") != value:
                    changed[f"rp:{key}:{part}"] = value
            if horizon is not None:
                horizons[key] = horizon
        held.set(changed)
    return horizons, {name: value for name, value in stored.items() if name.startswith(("rq:", "rs:"))}


@dataclass(frozen=True, kw_only=True)
class _Plan:
    """What one page sends again: the messages and, per message, its kind and target."""

    messages: list[TaskMessage]
    resent: list[Resent]


@dataclass(frozen=True, kw_only=True)
class _Candidate:
    """A row its target has not recorded: the message to send if it is lost, where it would wait."""

    row: Any
    target: str  # progress key
    message: TaskMessage
    queue: str
    since_ms: int  # its publish time, or its last failed delivery's


def _belongs(window: _Window, row: Any, idempotent_tasks: Collection[str]) -> bool:
    """Whether ``row`` (already filtered by type for event and task windows) is one of ``window``'s."""
    task = is_task_row(row.headers)
    if window.kind == "event":
        return not task
    if window.kind == "task":
        return task
    return task and row.type not in idempotent_tasks and wants_receipt((row.headers or {}).get("task_headers"))


def _target(window: _Window, row: Any) -> str:
    """The progress key of ``row`` in ``window``: the event consumer, the task key, the plain task name."""
    if window.kind == "event":
        return window.consumer
    return task_key(row.type) if window.kind == "task" else plain_target(row.type)


def _page(session: Session, window: _Window, since: tuple[int, int], upto: int, evidence: _Evidence, *,
          tables: Tables, idempotent_tasks: Collection[str], namespace: str, max_message_bytes: int,
          limit: int) -> tuple[int, tuple[int, int], _Plan, bool]:
    """Read one page of ``window`` after ``since``; (rows checked, the next watermark, what to send,
    whether the window stopped at a message not proved lost)."""
    since_ms, since_seq = since
    o = tables.outbox
    published = o.published_at_ms
    query = (sa.select(o.seq, o.message_id, o.type, o.headers, o.created_at_ms, published)
             # The redundant ``published >= since_ms`` bounds the index scan on ix_<prefix>published from
             # below; without it Postgres walks every row published before the watermark (the OR is a filter).
             .where(published.is_not(None), published <= upto, published >= since_ms,
                    sa.or_(published > since_ms, sa.and_(published == since_ms, o.seq > since_seq))))
    if window.kind != "plain_task":
        query = query.where(o.type.in_(sorted(window.types)))
    rows = session.execute(query.order_by(published, o.seq).limit(limit)).all()
    # A full page means more rows in the window: stop at the last (ms, seq) checked, never inside a ms.
    next_mark = (int(rows[-1].published_at_ms), int(rows[-1].seq)) if len(rows) == limit else (upto, _ALL)
    candidates = []
    for r in rows:
        if _belongs(window, r, idempotent_tasks):
            candidates.append(r)
    empty = _Plan(messages=[], resent=[])
    if not candidates:
        return len(rows), next_mark, empty, False
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
    failed = {(m, c): int(at) for m, c, at in session.execute(
        sa.select(tables.attempts.message_id, tables.attempts.consumer, tables.attempts.last_failed_at_ms)
        .where(tables.attempts.message_id.in_(ids)))}
    missing = []
    for r in candidates:
        if window.kind == "event":
            if (r.message_id, window.consumer) in seen or (str(r.message_id), window.consumer) in dead:
                continue
        # A dead letter of this task id under any key (the task's, a poison gate's) is a person's job.
        elif (r.message_id, task_key(r.type)) in seen or str(r.message_id) in dead_ids or r.message_id in received:
            continue
        missing.append(r)
    if not missing:
        return len(rows), next_mark, empty, False
    payloads: dict[int, Any] = {seq: payload for seq, payload in session.execute(
        sa.select(o.seq, o.payload).where(o.seq.in_([r.seq for r in missing])))}
    lost: list[_Candidate] = []
    for r in missing:
        headers = dict(r.headers or {})
        try:
            if window.kind == "event":
                envelope = Envelope(message_id=r.message_id, type=r.type, payload=payloads[r.seq], headers=headers,
                                    created_at_ms=r.created_at_ms)
                [message] = celery_task_messages(envelope, targets=[(window.consumer, f"{namespace}.{window.consumer}")],
                                                 max_bytes=max_message_bytes)
            else:
                message = task_row_message(message_id=r.message_id, type=r.type, payload=payloads[r.seq],
                                           headers=headers, max_bytes=max_message_bytes)
        except (SerializationError, MessageTooLargeError, MalformedMessageError) as e:  # the relay sent it: unlikely
            log.warning("reconcile: cannot rebuild %s: %s", r.message_id, e)
            continue
        target = _target(window, r)
        inbox_key = window.consumer if window.kind == "event" else task_key(r.type)
        since_ms = max(int(r.published_at_ms), failed.get((r.message_id, inbox_key), _NEVER))
        queue = message.queue.name if message.queue is not None else message.routing_key
        lost.append(_Candidate(row=r, target=target, message=message, queue=queue, since_ms=since_ms))
    evidence.ask({c.queue for c in lost if not c.since_ms < evidence.horizons.get(_digest(c.target), _NEVER)})
    plan = _Plan(messages=[], resent=[])
    for c in lost:
        passed = c.since_ms < evidence.horizons.get(_digest(c.target), _NEVER)
        if not passed and not (c.since_ms <= upto and evidence.broker_holds_no_copy(c.queue, c.message.message_id)):
            # Not recorded and not proved lost: waiting behind a backlog, or in a retry. Stop here; the rows
            # before it are done, this one and the rest of the page are checked again next pass.
            before = [r for r in rows if (r.published_at_ms, r.seq) < (c.row.published_at_ms, c.row.seq)]
            mark = (int(before[-1].published_at_ms), int(before[-1].seq)) if before else since
            return len(rows), mark, plan, True
        plan.messages.append(c.message)
        plan.resent.append(Resent(kind=window.kind, message_id=str(c.row.message_id),
                                  target=window.consumer if window.kind == "event" else c.row.type))
    return len(rows), next_mark, plan, False


def reconcile(session: Session, publisher: Publisher, clock: Clock, *, tables: Tables, routes: Mapping[str, Sequence[str]],
              namespace: str, max_message_bytes: int, older_than_ms: int, idempotent_tasks: Collection[str] = (),
              plain_older_than_ms: int = 0, limit: int = 1000, max_pages: int = 100,
              queues: QueueInspector | None = None, publish_skew_ms: int = 10_000) -> ReconcileResult:
    """One pass over every window, in one transaction unless it sends something (it commits before each
    publish and after it) or a window has more than a page (it commits after each page). The first pass of a
    window only sets its watermark (history is not re-checked). ``idempotent_tasks``: the ``@outbox.task`` names this app
    defines (the relay passes them as it passes ``routes``); ``plain_older_than_ms`` 0: plain tasks off.
    ``queues``: the broker's queue probe (relay/queues.py); None: the publisher's, if it has one, else no
    broker evidence. ``publish_skew_ms``: the longest a publish can be marked after a later one was sent
    (the relay's publish timeout)."""
    now = clock.now_ms()
    result = ReconcileResult(watermark_ms=now - older_than_ms)
    if queues is None and isinstance(publisher, QueueInspector):
        queues = publisher
    consumers: dict[str, set[str]] = {}
    for event_type, names in routes.items():
        for name in names:
            consumers.setdefault(name, set()).add(event_type)
    windows = []
    for consumer, types in sorted(consumers.items()):
        mark_ms, mark_seq = event_watermark(consumer)
        windows.append(_Window(kind="event", mark_ms=mark_ms, mark_seq=mark_seq, older_than_ms=older_than_ms,
                               consumer=consumer, types=frozenset(types)))
    if idempotent_tasks:
        windows.append(_Window(kind="task", mark_ms=TASK_WATERMARK, mark_seq=TASK_WATERMARK_SEQ,
                               older_than_ms=older_than_ms, types=frozenset(idempotent_tasks)))
    plain = _Window(kind="plain_task", mark_ms=PLAIN_WATERMARK, mark_seq=PLAIN_WATERMARK_SEQ,
                    older_than_ms=max(plain_older_than_ms, older_than_ms))  # never before the events'
    held = _Counters(names=(SAMPLED, WATERMARK, WATERMARK_SEQ, plain.mark_ms, plain.mark_seq,
                            *(n for w in windows for n in (w.mark_ms, w.mark_seq))))
    if plain_older_than_ms > 0:
        windows.append(plain)
        result.plain_watermark_ms = now - plain.older_than_ms
    else:
        with wrap_driver_errors("turning off the plain-task reconcile window"):
            forgot = held.forget((plain.mark_ms, plain.mark_seq), session=session, tables=tables)
        if forgot:  # once when it is turned off; on every pass when another process still has it on
            log.warning("plain-task reconcile is off here (OUTBOX_RELAY_RECONCILE_PLAIN_TASKS_AFTER_MS=0): its "
                        "watermark was reset. If another relay or beat still has it on, each of its passes now "
                        "starts afresh and lost plain tasks are never sent again: set the same value everywhere")
    horizons, quiet = _sample_progress(session, now, held, tables=tables, floor_ms=older_than_ms,
                                       skew_ms=publish_skew_ms, plain=plain_older_than_ms > 0)
    evidence = _Evidence(now=now, floor_ms=older_than_ms, horizons=horizons, inspector=queues, quiet=quiet)
    empty = _nothing_published(session, held, windows, now, tables=tables)
    for window in windows:
        if not _run_window(session, publisher, window, now - window.older_than_ms, result, evidence, held,
                           tables=tables, idempotent_tasks=frozenset(idempotent_tasks), namespace=namespace,
                           max_message_bytes=max_message_bytes, limit=limit, max_pages=max_pages, empty=empty):
            break
    with wrap_driver_errors("writing the reconcile counters"):
        _remember_quiet(evidence, held, stored=quiet)
        if evidence.probe_failed:
            result.probe_failed = True
            counters.stage_increment(session, counters.RELAY, PROBE_FAILURES, 1, tables=tables)
        held.commit(session, tables=tables)
    return result


def _nothing_published(session: Session, held: _Counters, windows: Sequence[_Window], now: int, *,
                       tables: Tables) -> bool:
    """Whether no row was published in any window's span, from its watermark to its end: then no window has a
    page to read (one statement instead of one page per window, on every idle pass)."""
    with wrap_driver_errors("reconciling the outbox with the inbox"):
        marks = [held.watermark(session, w, tables=tables) for w in windows]
        if not windows or any(m is None for m in marks):
            return False
        published = tables.outbox.published_at_ms
        lo, hi = min(m[0] for m in marks if m is not None), max(now - w.older_than_ms for w in windows)
        return session.execute(sa.select(tables.outbox.seq).where(
            published.is_not(None), published >= lo, published <= hi).limit(1)).first() is None


def _remember_quiet(evidence: _Evidence, held: _Counters, *, stored: Mapping[str, int]) -> None:
    """Since when each asked RabbitMQ queue with consumers has had nothing waiting, and when an ask last saw
    it so; forgotten when it has something waiting (written at ``held``'s commit)."""
    keep: dict[str, int] = {}
    drop: list[str] = []
    for queue, state in evidence.states.items():
        name, seen = _quiet_name(queue), _quiet_seen_name(queue)
        if state is not None and state.ready == 0 and state.holds_no_copy_of("") is None:
            if name not in stored or stored.get(seen, 0) < evidence.now - evidence.floor_ms // 2:
                keep[name] = evidence.now
            keep[seen] = evidence.now
        elif state is not None:
            drop.extend(n for n in (name, seen) if n in stored)
    held.set(keep)
    held.drop.update(drop)


def _run_window(session: Session, publisher: Publisher, window: _Window, upto: int, result: ReconcileResult,
                evidence: _Evidence, held: _Counters, *, tables: Tables, idempotent_tasks: Collection[str],
                namespace: str, max_message_bytes: int, limit: int, max_pages: int, empty: bool) -> bool:
    """Page through ``window`` up to ``upto``; False when the broker was unavailable (stop the pass).
    ``empty``: nothing was published in the window's span (``_nothing_published``), so no page is read.

    The watermark only moves forward. Two passes can disagree on ``upto`` (a clock ahead or behind on
    another host, a pass that overran its lease): one whose window ends before the watermark does nothing,
    and the write re-reads the watermark under its lock when the lock was let go for a publish. A watermark
    moved back would check a span again and send its lost messages a second time while the first re-send
    may still be queued (a plain task has no inbox to absorb it)."""
    for _ in range(max_pages):
        with wrap_driver_errors("reconciling the outbox with the inbox"):
            since = held.watermark(session, window, tables=tables)
            if since is None:
                found = held.read(session, tables=tables)
                legacy = None
                if window.kind != "plain_task" and WATERMARK in found:  # one watermark used to cover events and tasks
                    legacy = (found[WATERMARK], found.get(WATERMARK_SEQ, _ALL))
                held.set(_marks(window, min(legacy, (upto, _ALL)) if legacy else (upto, _ALL)))
                if legacy is None:
                    return True
                continue
            if since >= (upto, _ALL):  # another pass checked past this window's end
                return True
            if empty:
                checked, next_mark, plan, stopped = 0, (upto, _ALL), _Plan(messages=[], resent=[]), False
            else:
                checked, next_mark, plan, stopped = _page(session, window, since, upto, evidence, tables=tables,
                                                          idempotent_tasks=idempotent_tasks, namespace=namespace,
                                                          max_message_bytes=max_message_bytes, limit=limit)
            if plan.messages:
                held.commit(session, tables=tables)  # what the pass has so far: hold no locks across the publish
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
            # Nothing sent: still in the transaction that read (and locked) ``since``.
            current = held.watermark(session, window, tables=tables) if plan.messages else since
            if current is None or current < next_mark:
                held.set(_marks(window, next_mark))
            counters.stage_increment(session, counters.RELAY, counters.RECONCILED, len(plan.messages), tables=tables)
            for kind, n in per_kind.items():
                counters.stage_increment(session, counters.RELAY, KINDS[kind], n, tables=tables)
            if plan.messages or (not stopped and next_mark[1] != _ALL):  # sent, or another page follows
                held.commit(session, tables=tables)
        result.republished += len(plan.messages)
        result.events += per_kind["event"]
        result.tasks += per_kind["task"]
        result.plain_tasks += per_kind["plain_task"]
        result.resent.extend(plan.resent)
        if window.plain:
            result.plain_watermark_ms = next_mark[0]
        else:
            result.watermark_ms = min(result.watermark_ms, next_mark[0])
        if stopped:
            result.waiting += 1
            return True
        if next_mark[1] == _ALL:  # caught up with the window
            return True
    return True
