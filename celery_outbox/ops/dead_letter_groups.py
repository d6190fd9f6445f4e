"""Dead letters in groups: list them by failure, replay or purge (or archive) a whole group, throttled.

A group is a fingerprint (``inbox/fingerprints.py``): one consumer, task or the relay failing with one
exception type and one normalised message. Consumer dead letters store it (indexed with the id and the
failure time, so listing the groups of 100,000 dead letters is one index-only scan); the relay's dead
rows are few (a broker outage dead-letters nothing) and are fingerprinted as they are read, through
the partial index that holds only them.

A group run (replay or purge) walks the group in id order, one short transaction per dead letter
(replay) or per batch (purge), at most ``rate`` per second. Its progress is a job row in
``outbox_counters`` (scope ``_replay:<group>`` / ``_purge:<group>``) incremented in the SAME commit
as the mark or delete it counts, so the figures are exact whatever dies when: run it again after a
crash and it resumes with the dead letters left and reports what the first run did, never a row
twice. The one thing no database commit can cover is a replay sent to the broker whose mark did not
commit: that message is sent again by the resumed run, counted once, and the inbox absorbs it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import counters
from celery_outbox.clock import Clock
from celery_outbox.config.masking import mask_secrets
from celery_outbox.db import wrap_driver_errors
from celery_outbox.errors import NotFoundError, ValidationError
from celery_outbox.inbox.dead_letters import envelope_of, send_replay
from celery_outbox.inbox.fingerprints import FINGERPRINT_CHARS, error_class, fingerprint, normalise
from celery_outbox.inbox.task_keys import is_task_key
from celery_outbox.ops.archive import Archive, encode
from celery_outbox.ops.dead_letters import DeadLetterId, Sender, Source
from celery_outbox.schema import DeadLetterRow, OutboxRow, Tables
from celery_outbox.sql import upsert

DEFAULT_BATCH = 500
DEFAULT_REPLAY_RATE = 200.0  # dead letters per second: a group replay must not flood the consumers it feeds
DEFAULT_PURGE_RATE = 5000.0
UNSET = "unset"  # the group of dead letters written before fingerprints existed and not yet filled in
OUTBOX_SCOPE = "relay"
Action = Literal["replay", "purge"]


@dataclass(frozen=True, kw_only=True)
class Group:
    id: str
    source: Source
    consumer: str  # the consumer, the task key (task:<name>), or relay:<event type> for the relay's rows
    error_class: str
    message: str  # the normalised message
    count: int
    first_seen_ms: int
    last_seen_ms: int
    sample_id: str
    sample_error: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "consumer": self.consumer, "error_class": self.error_class,
                "message": self.message, "count": self.count, "first_seen_ms": self.first_seen_ms,
                "last_seen_ms": self.last_seen_ms, "sample_id": self.sample_id, "sample_error": self.sample_error}


def check_group_id(raw: object) -> str:
    """A group id exactly as ``outbox dead-letters groups`` prints it (hex), or ``unset``; surrounding blanks
    are refused, as in a dead-letter id (docs/operations.md)."""
    if isinstance(raw, str) and (raw == UNSET or (len(raw) == FINGERPRINT_CHARS
                                                  and all(c in "0123456789abcdef" for c in raw))):
        return raw
    shown = repr(raw)
    raise ValidationError(f"{shown[:80]} is not a dead-letter group; see 'outbox dead-letters groups'")


def _outbox_fp(row_type: str, error: str | None) -> str:
    return fingerprint(source="outbox", consumer=f"{OUTBOX_SCOPE}:{row_type}", error=error or "")


def _outbox_dead(session: Session, tables: Tables, *, after: int = 0, limit: int | None = None
                 ) -> list[tuple[int, str, str | None, int]]:
    o = tables.outbox
    stmt = sa.select(o.seq, o.type, o.last_error, o.dead_lettered_at_ms).where(
        o.dead_lettered_at_ms.is_not(None), o.seq > after).order_by(o.seq)
    if limit is not None:
        stmt = stmt.limit(limit)
    return [(int(s), t, e, int(d or 0)) for s, t, e, d in session.execute(stmt)]


def list_groups(session: Session, *, tables: Tables) -> list[Group]:
    """Every group of unreplayed dead letters, largest first."""
    d = tables.dead_letters
    with wrap_driver_errors("listing dead-letter groups"):
        agg = session.execute(
            sa.select(d.fingerprint, sa.func.count(), sa.func.min(d.last_failed_at_ms), sa.func.max(d.last_failed_at_ms),
                      sa.func.min(d.id))
            .where(d.replayed_at_ms.is_(None)).group_by(d.fingerprint)).all()
        samples = {r.id: r for r in session.execute(
            sa.select(d.id, d.consumer, d.last_error).where(d.id.in_([int(a[4]) for a in agg])))} if agg else {}
        groups: list[Group] = []
        for fp, n, first, last, sample in agg:
            s = samples[int(sample)]
            groups.append(Group(id=fp or UNSET, source="consumer", consumer=s.consumer, error_class=error_class(s.last_error),
                                message=normalise(mask_secrets(s.last_error)), count=int(n), first_seen_ms=int(first),
                                last_seen_ms=int(last), sample_id=f"consumer:{int(sample)}",
                                sample_error=mask_secrets(s.last_error)))
        relay: dict[str, Group] = {}
        for seq, type_, error, at in _outbox_dead(session, tables):
            fp = _outbox_fp(type_, error)
            g = relay.get(fp)
            if g is None:
                relay[fp] = Group(id=fp, source="outbox", consumer=f"{OUTBOX_SCOPE}:{type_}",
                                  error_class=error_class(error or ""), message=normalise(mask_secrets(error or "")),
                                  count=1, first_seen_ms=at, last_seen_ms=at, sample_id=f"outbox:{seq}",
                                  sample_error=mask_secrets(error or ""))
            else:
                relay[fp] = replace(g, count=g.count + 1, first_seen_ms=min(g.first_seen_ms, at),
                                    last_seen_ms=max(g.last_seen_ms, at))
    groups.extend(relay.values())
    groups.sort(key=lambda g: (-g.count, g.first_seen_ms, g.id))
    return groups


def get_group(session: Session, group_id: str, *, tables: Tables) -> Group:
    gid = check_group_id(group_id)
    for g in list_groups(session, tables=tables):
        if g.id == gid:
            return g
    raise NotFoundError(f"no dead letters left in group {gid} (see 'outbox dead-letters groups')")


def _consumer_filter(tables: Tables, gid: str) -> sa.ColumnElement[bool]:
    d = tables.dead_letters
    return d.fingerprint.is_(None) if gid == UNSET else d.fingerprint == gid


def members(session: Session, group: Group, *, tables: Tables, after: int, limit: int) -> list[DeadLetterId]:
    """The next ``limit`` unreplayed dead letters of the group with a row id above ``after``, in id order."""
    if group.source == "consumer":
        d = tables.dead_letters
        ids = session.scalars(sa.select(d.id).where(_consumer_filter(tables, group.id), d.replayed_at_ms.is_(None),
                                                    d.id > after).order_by(d.id).limit(limit)).all()
        return [DeadLetterId(source="consumer", row_id=int(i)) for i in ids]
    found: list[DeadLetterId] = []
    while len(found) < limit:
        rows = _outbox_dead(session, tables, after=after, limit=DEFAULT_BATCH)
        if not rows:
            break
        found.extend(DeadLetterId(source="outbox", row_id=s) for s, t, e, _ in rows if _outbox_fp(t, e) == group.id)
        after = rows[-1][0]
    return found[:limit]


# -- the job row: exact progress across crashes -------------------------------------------------------------------

def _scope(action: Action, gid: str) -> str:
    return f"_{action}:{gid}"


def _job(session: Session, scope: str, *, tables: Tables) -> dict[str, int]:
    c = tables.counters  # a counter's stripes added up (celery_outbox/counters.py)
    return counters.fold((scope, n, v) for n, v in session.execute(sa.select(c.name, c.value)
                                                                   .where(c.consumer == scope))).get(scope, {})


def _set(session: Session, scope: str, name: str, value: int, *, tables: Tables) -> None:
    session.execute(upsert(session, tables.counters, {"consumer": scope, "name": name, "value": value},
                           keys=("consumer", "name"), update={"value": value}))


def _end_job(session: Session, scope: str, *, tables: Tables) -> None:
    session.execute(sa.delete(tables.counters).where(tables.counters.consumer == scope))
    session.commit()


@dataclass(frozen=True, kw_only=True)
class RunProgress:
    """One step of a group run: ``done`` of ``total`` (the group when the run began), ``line`` says what."""

    done: int
    total: int
    line: str


@dataclass(frozen=True, kw_only=True)
class RunReport:
    group: str
    action: Action
    done_now: int  # replayed (or purged) by this run
    done_before: int  # by an earlier run of the same job that did not finish (a crash)
    skipped: int  # could not be replayed (left in the group, with the reason on the progress lines)
    total: int  # the group's size when the job began
    resumed_from_ms: int | None  # when the unfinished earlier run began, if this run resumed it
    archived_to: str | None = None
    dry_run: bool = False
    plan: dict[str, int] | None = None  # dry run: what would be sent where (destination -> count)

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "action": self.action, "done_now": self.done_now, "done_before": self.done_before,
                "skipped": self.skipped, "total": self.total, "resumed_from_ms": self.resumed_from_ms,
                "archived_to": self.archived_to, "dry_run": self.dry_run, "plan": self.plan}


class Throttle:
    """At most ``rate`` items a second, averaged from the run's start (a pause is made up, not burst)."""

    def __init__(self, rate: float, *, sleep: Callable[[float], None] = time.sleep,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0:
            raise ValidationError(f"rate must be above 0 per second, got {rate!r}")
        self.rate, self.sleep, self.monotonic = rate, sleep, monotonic
        self.started = monotonic()
        self.count = 0

    def wait(self) -> None:
        due = self.started + self.count / self.rate
        now = self.monotonic()
        if due > now:
            self.sleep(due - now)
        self.count += 1


Progress = Callable[[RunProgress], None]


def _destination(row: DeadLetterRow) -> str:
    return f"task {row.type}" if is_task_key(row.consumer) else f"consumer {row.consumer}"


def _why_not(row: DeadLetterRow, send: Sender | None, known: tuple[str, ...] | None) -> str | None:
    """Why this consumer dead letter cannot be re-sent (None when it can)."""
    try:
        envelope = envelope_of(row)
        if is_task_key(row.consumer):
            check_task = getattr(send, "check_task", None)
            if callable(check_task):
                check_task(row.consumer, envelope)
        elif known is not None and row.consumer not in known:
            return f"consumer {row.consumer!r} is not configured here"
    except ValidationError as e:
        return str(e)
    return None


def _iter_batches(sessions: sessionmaker[Session], group: Group, *, tables: Tables, batch: int
                  ) -> Iterator[tuple[Session, list[DeadLetterId]]]:
    """Keyset batches of the group, each read in a fresh session (memory stays one batch, however large)."""
    after = 0
    while True:
        with sessions() as session:
            refs = members(session, group, tables=tables, after=after, limit=batch)
            if not refs:
                return
            yield session, refs
        after = refs[-1].row_id


def replay_group(sessions: sessionmaker[Session], group_id: str, *, tables: Tables, clock: Clock,
                 send: Sender | None = None, known_consumers: Iterable[str] | None = None, dry_run: bool = False,
                 rate: float = DEFAULT_REPLAY_RATE, batch: int = DEFAULT_BATCH, progress: Progress | None = None,
                 sleep: Callable[[float], None] = time.sleep, monotonic: Callable[[], float] = time.monotonic,
                 ) -> RunReport:
    """Replay every dead letter of the group (see the module docstring); ``dry_run`` says what would be
    sent where and what could not be, and changes nothing."""
    known = None if known_consumers is None else tuple(known_consumers)
    with sessions() as session:
        group = get_group(session, group_id, tables=tables)
        scope = _scope("replay", group.id)
        job = _job(session, scope, tables=tables)
        if not dry_run and not job:
            _set(session, scope, "total", group.count, tables=tables)
            _set(session, scope, "started_at_ms", clock.now_ms(), tables=tables)
            session.commit()
            job = _job(session, scope, tables=tables)
    if group.source == "consumer" and send is None and not dry_run:
        raise ValidationError("replaying a consumer dead letter needs a broker sender")
    before = job.get("done", 0)
    total = job.get("total", group.count)
    throttle = Throttle(rate, sleep=sleep, monotonic=monotonic)
    plan: dict[str, int] = {}
    done = skipped = 0
    with wrap_driver_errors(f"replaying dead-letter group {group.id}"):
        for session, refs in _iter_batches(sessions, group, tables=tables, batch=batch):
            if group.source == "consumer":
                _load_batch(session, refs, tables=tables, forget=not dry_run)
            for ref in refs:
                if group.source == "outbox":
                    line = _replay_outbox_row(session, ref, scope=scope, tables=tables, clock=clock, dry_run=dry_run,
                                              plan=plan, throttle=throttle)
                    ok = True
                else:
                    ok, line = _replay_consumer_row(session, ref, scope=scope, tables=tables, clock=clock, send=send,
                                                    known=known, dry_run=dry_run, plan=plan, throttle=throttle)
                done += ok
                skipped += not ok
                if progress is not None:
                    progress(RunProgress(done=before + done + skipped, total=total, line=line))
            session.expunge_all()
        if not dry_run:
            with sessions() as session:
                _end_job(session, scope, tables=tables)
    return RunReport(group=group.id, action="replay", done_now=0 if dry_run else done, done_before=before,
                     skipped=skipped, total=total, dry_run=dry_run,
                     resumed_from_ms=job.get("started_at_ms") if before else None, plan=plan if dry_run else None)


def _replay_outbox_row(session: Session, ref: DeadLetterId, *, scope: str, tables: Tables, clock: Clock, dry_run: bool,
                       plan: dict[str, int], throttle: Throttle) -> str:
    if dry_run:
        plan["the relay (back in the outbox, due now)"] = plan.get("the relay (back in the outbox, due now)", 0) + 1
        return f"{ref}: would go back in the outbox, due now"
    throttle.wait()
    session.execute(sa.update(tables.outbox)
                    .where(tables.outbox.seq == ref.row_id, tables.outbox.dead_lettered_at_ms.is_not(None))
                    .values(dead_lettered_at_ms=None, attempts=0, next_attempt_at_ms=clock.now_ms())
                    .execution_options(synchronize_session=False))
    counters.stage_increment(session, scope, "done", tables=tables)
    session.commit()
    return f"{ref}: back in the outbox, due now"


def _replay_consumer_row(session: Session, ref: DeadLetterId, *, scope: str, tables: Tables, clock: Clock,
                         send: Sender | None, known: tuple[str, ...] | None, dry_run: bool, plan: dict[str, int],
                         throttle: Throttle) -> tuple[bool, str]:
    row = session.get(tables.dead_letters, ref.row_id)
    if row is None or row.replayed_at_ms is not None:  # replayed or purged meanwhile by someone else
        return False, f"{ref}: gone or already replayed; left alone"
    why = _why_not(row, send, known)
    if why is not None:
        return False, f"{ref}: skipped: {why}"
    where = _destination(row)
    if dry_run:
        plan[where] = plan.get(where, 0) + 1
        return True, f"{ref}: would be re-sent to {where} (message {row.message_id})"
    throttle.wait()
    envelope = envelope_of(row)
    assert send is not None
    same_task = send_replay(send, row, envelope)  # under the dead-lettered delivery's task id when it was kept
    row.replayed_at_ms = clock.now_ms()
    counters.stage_increment(session, scope, "done", tables=tables)
    session.commit()
    return True, f"{ref}: re-sent to {where}" + (f" as task {row.task_id}" if same_task else "")


def _load_batch(session: Session, refs: list[DeadLetterId], *, tables: Tables, forget: bool) -> None:
    """The batch's rows in one query (the identity map serves each ``get`` after it); with ``forget``, their
    delivery counts are cleared in one commit before any is sent (a replay starts with full deliveries)."""
    d = tables.dead_letters
    rows = list(session.scalars(sa.select(d).where(d.id.in_([r.row_id for r in refs]))))
    if forget:
        _forget_attempts(session, tables=tables, rows=[r for r in rows if r.replayed_at_ms is None])
        session.commit()


def _forget_attempts(session: Session, *, tables: Tables, rows: Iterable[DeadLetterRow]) -> None:
    """The delivery counts of these messages start afresh (as the single replay and purge do)."""
    keys = []
    for r in rows:
        try:
            keys.append({"b_mid": uuid.UUID(r.message_id), "b_consumer": r.consumer})
        except ValueError:
            continue
    if keys:
        a = tables.table(tables.attempts)  # Core: an executemany DELETE (the ORM has no bulk delete)
        session.connection().execute(sa.delete(a).where(a.c.message_id == sa.bindparam("b_mid"),
                                                        a.c.consumer == sa.bindparam("b_consumer")), keys)


def _archive_line(row: DeadLetterRow | OutboxRow) -> dict[str, Any]:
    if isinstance(row, DeadLetterRow):
        return {"id": f"consumer:{row.id}", "consumer": row.consumer, "message_id": row.message_id, "type": row.type,
                "body": row.body, "headers": row.headers, "delivery_count": row.delivery_count,
                "last_error": row.last_error, "first_failed_at_ms": row.first_failed_at_ms,
                "last_failed_at_ms": row.last_failed_at_ms, "fingerprint": row.fingerprint}
    return {"id": f"outbox:{row.seq}", "message_id": str(row.message_id), "type": row.type, "payload": row.payload,
            "headers": row.headers, "attempts": row.attempts, "last_error": row.last_error,
            "created_at_ms": row.created_at_ms, "dead_lettered_at_ms": row.dead_lettered_at_ms}


def purge_group(sessions: sessionmaker[Session], group_id: str, *, tables: Tables, clock: Clock,
                archive: Path | str | None = None, rate: float = DEFAULT_PURGE_RATE, batch: int = DEFAULT_BATCH,
                progress: Progress | None = None, sleep: Callable[[float], None] = time.sleep,
                monotonic: Callable[[], float] = time.monotonic) -> RunReport:
    """Delete every dead letter of the group, a batch per transaction; with ``archive``, each batch is first
    appended to that JSON-lines file and flushed to disk (a row is deleted only once it is archived; the
    file is checked before anything is deleted: ``celery_outbox/ops/archive.py``)."""
    with sessions() as session:
        group = get_group(session, group_id, tables=tables)
    out = Archive.open(archive) if archive is not None else None
    try:
        return _purge(sessions, group, tables=tables, clock=clock, out=out, rate=rate, batch=batch,
                      progress=progress, sleep=sleep, monotonic=monotonic)
    finally:
        if out is not None:
            out.close()


def _purge(sessions: sessionmaker[Session], group: Group, *, tables: Tables, clock: Clock, out: Archive | None,
           rate: float, batch: int, progress: Progress | None, sleep: Callable[[float], None],
           monotonic: Callable[[], float]) -> RunReport:
    with sessions() as session:
        scope = _scope("purge", group.id)
        job = _job(session, scope, tables=tables)
        if not job:
            _set(session, scope, "total", group.count, tables=tables)
            _set(session, scope, "started_at_ms", clock.now_ms(), tables=tables)
            session.commit()
            job = _job(session, scope, tables=tables)
    before, total = job.get("done", 0), job.get("total", group.count)
    throttle = Throttle(rate / batch, sleep=sleep, monotonic=monotonic)
    done = 0
    with wrap_driver_errors(f"purging dead-letter group {group.id}"):
        for session, refs in _iter_batches(sessions, group, tables=tables, batch=batch):
            throttle.wait()
            ids = [r.row_id for r in refs]
            if group.source == "consumer":
                d = tables.dead_letters
                rows: list[Any] = list(session.scalars(sa.select(d).where(d.id.in_(ids)).order_by(d.id)
                                                       .with_for_update()))
            else:
                o = tables.outbox
                rows = list(session.scalars(sa.select(o).where(o.seq.in_(ids), o.dead_lettered_at_ms.is_not(None))
                                            .order_by(o.seq).with_for_update()))
            if out is not None:
                lines = [encode(_archive_line(row)) for row in rows]
                out.write([line for line in lines if not out.holds(line)])
            if group.source == "consumer":
                _forget_attempts(session, tables=tables, rows=rows)
                res = session.execute(sa.delete(tables.dead_letters).where(tables.dead_letters.id.in_(ids),
                                                                           tables.dead_letters.replayed_at_ms.is_(None)))
            else:
                res = session.execute(sa.delete(tables.outbox).where(tables.outbox.seq.in_(ids),
                                                                     tables.outbox.dead_lettered_at_ms.is_not(None)))
            n = int(getattr(res, "rowcount", 0))
            counters.stage_increment(session, scope, "done", n, tables=tables)
            session.commit()
            done += n
            if progress is not None:
                progress(RunProgress(done=before + done, total=total,
                                     line=f"batch of {n} deleted{' (archived first)' if out else ''}: "
                                          f"{before + done}/{total}"))
        with sessions() as session:
            _end_job(session, scope, tables=tables)
    return RunReport(group=group.id, action="purge", done_now=done, done_before=before, skipped=0, total=total,
                     resumed_from_ms=job.get("started_at_ms") if before else None,
                     archived_to=out.path if out is not None else None)
