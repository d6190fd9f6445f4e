"""What an operator asks first: is the outbox draining, is anything dead, are duplicates being absorbed.

Every figure is read from the database, so it is the same whichever process (web app, relay, worker)
serves it, and it survives restarts. Queries use the partial indexes: the pending figures are O(pending),
not O(history). A task held in the outbox for a later eta (docs/scheduled.md) is "scheduled", counted
apart: a reminder due tomorrow is not a stuck backlog, so it never ages the oldest pending row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.orm import Session

from celery_outbox import counters as relay_counters
from celery_outbox.clock import Clock
from celery_outbox.errors import ConfigError
from celery_outbox.ops import partitions
from celery_outbox.ops.partitions import Headroom
from celery_outbox.schema import Tables

log = logging.getLogger(__name__)

# The reconciler's counters, by kind (relay/reconcile.py).
RECONCILED_KINDS = {"events": relay_counters.RECONCILED_EVENTS, "tasks": relay_counters.RECONCILED_TASKS,
                    "plain_tasks": relay_counters.RECONCILED_PLAIN_TASKS}


@dataclass(frozen=True, kw_only=True)
class DeadLetterGroup:
    source: str
    consumer: str | None
    count: int
    oldest_age_ms: int

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "consumer": self.consumer, "count": self.count,
                "oldest_age_ms": self.oldest_age_ms}


@dataclass(frozen=True, kw_only=True)
class WaitingForWorker:
    """Task rows the relay holds because a live worker of their queue does not run them yet (a rolling
    deploy; celery_outbox/workers.py): ``what`` is e.g. ``billing.charge v2 on queue billing``."""

    what: str
    count: int
    oldest_age_ms: int  # since the oldest of them was written

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "count": self.count, "oldest_age_ms": self.oldest_age_ms}


@dataclass(frozen=True, kw_only=True)
class SlotHorizon:
    """A replication slot holding back vacuum: ``xmin`` (a physical slot with hot_standby_feedback) holds every
    table's dead tuples, ``catalog_xmin`` (a logical slot) the system catalogs'. Ages in transaction ids: a
    slot keeps no timestamp of its horizon."""

    slot: str
    active: bool
    xmin_age_xids: int | None
    catalog_xmin_age_xids: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"slot": self.slot, "active": self.active, "xmin_age_xids": self.xmin_age_xids,
                "catalog_xmin_age_xids": self.catalog_xmin_age_xids}


@dataclass(frozen=True, kw_only=True)
class TableVacuumStats:
    """One hot table's dead and live tuples (pg_stat_user_tables, estimates) and its last vacuums."""

    table: str
    dead_tuples: int
    live_tuples: int
    last_autovacuum_ms: int | None  # epoch ms; None: never since the statistics were reset
    last_vacuum_ms: int | None  # a manual VACUUM

    def to_dict(self) -> dict[str, Any]:
        return {"table": self.table, "dead_tuples": self.dead_tuples, "live_tuples": self.live_tuples,
                "last_autovacuum_ms": self.last_autovacuum_ms, "last_vacuum_ms": self.last_vacuum_ms}


@dataclass(frozen=True, kw_only=True)
class VacuumStats:
    """Postgres: what predicts a bloated outbox (docs/operations.md, "Vacuum and bloat"). The oldest transaction
    that holds back vacuum in this database (a session's ``backend_xmin``/``backend_xid``, or a prepared
    transaction), the replication slots, and the outbox and inbox tables' dead tuples."""

    oldest_xact_age_xids: int | None  # None: no transaction holds the horizon back
    oldest_xact_age_ms: int | None  # how long the longest-open of them has been open
    oldest_xact: str | None  # who, for people: "pid 123 psql (idle in transaction)" or "prepared 'x'"
    slots: list[SlotHorizon] = field(default_factory=list)
    tables: list[TableVacuumStats] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"oldest_xact_age_xids": self.oldest_xact_age_xids, "oldest_xact_age_ms": self.oldest_xact_age_ms,
                "oldest_xact": self.oldest_xact, "replication_slots": [s.to_dict() for s in self.slots],
                "tables": [t.to_dict() for t in self.tables]}


@dataclass(frozen=True, kw_only=True)
class Stats:
    now_ms: int
    pending: int
    due: int
    retrying: int  # pending rows that have failed at least once (publish failures not yet dead)
    # How long the longest-waiting row has been waiting to go out: counted from when it could first be
    # published (its creation, or the eta it was held until), over every pending row but the scheduled ones.
    oldest_pending_age_ms: int | None
    published: int  # published rows still retained (retention shrinks this)
    # How long the longest-due pending row has been due and unpublished. A row backing off after a failed
    # publish is not due yet, so it never counts: this grows only when no relay is claiming due rows.
    oldest_overdue_ms: int | None = None
    # Rows held for a later eta (docs/scheduled.md): not a backlog, so outside the figures above; when the
    # first of them is due.
    scheduled: int = 0
    next_due_at_ms: int | None = None
    # Postgres: how long the oldest relay claim in flight (rows locked FOR UPDATE by a claim that has not
    # committed its mark) has been open. A relay stopped or stuck mid-batch holds its rows here, unpublished,
    # while every other relay skips them. None when no claim is open (always on SQLite: see ``claim_held_ms``).
    claim_held_ms: int | None = None
    # Rows held for a worker that runs them (a rolling deploy): also outside the backlog figures above.
    waiting_for_worker: list[WaitingForWorker] = field(default_factory=list)
    dead_letters: list[DeadLetterGroup] = field(default_factory=list)
    inbox: dict[str, int] = field(default_factory=dict)
    duplicates_absorbed: dict[str, int] = field(default_factory=dict)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)  # consumer -> name -> value
    # Postgres only (None on SQLite, which has no vacuum): what holds back vacuum, and the dead tuples.
    vacuum: VacuumStats | None = None
    # The partitioned layout only (docs/partitioning.md): rows the table takes before a write fails.
    partitions: Headroom | None = None

    @property
    def reconciled(self) -> dict[str, int]:
        """Messages the reconciler published again since the database began: total and per kind."""
        relay = self.counters.get(relay_counters.RELAY, {})
        out = {"total": relay.get(relay_counters.RECONCILED, 0)}
        out.update({kind: relay.get(name, 0) for kind, name in RECONCILED_KINDS.items()})
        return out

    @property
    def batches(self) -> dict[str, dict[str, float]]:
        """Per batch consumer: batches committed, the messages in them and their mean size (inbox/batch.py)."""
        out: dict[str, dict[str, float]] = {}
        for consumer, named in self.counters.items():
            n, m = named.get(relay_counters.BATCHES, 0), named.get(relay_counters.BATCHED_MESSAGES, 0)
            if n:
                out[consumer] = {"batches": n, "messages": m, "mean_size": round(m / n, 2)}
        return out

    @property
    def dead_letter_total(self) -> int:
        return sum(g.count for g in self.dead_letters)

    @property
    def oldest_dead_letter_age_ms(self) -> int | None:
        return max((g.oldest_age_ms for g in self.dead_letters), default=None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "now_ms": self.now_ms,
            "outbox": {"pending": self.pending, "due": self.due, "retrying": self.retrying,
                       "oldest_pending_age_ms": self.oldest_pending_age_ms, "published_retained": self.published,
                       "oldest_overdue_ms": self.oldest_overdue_ms, "claim_held_ms": self.claim_held_ms,
                       "scheduled": self.scheduled, "next_due_at_ms": self.next_due_at_ms,
                       "waiting_for_worker": [w.to_dict() for w in self.waiting_for_worker]},
            "dead_letters": {"total": self.dead_letter_total, "oldest_age_ms": self.oldest_dead_letter_age_ms,
                             "groups": [g.to_dict() for g in self.dead_letters]},
            "inbox": {"total": sum(self.inbox.values()), "per_consumer": dict(self.inbox)},
            "duplicates_absorbed": {"total": sum(self.duplicates_absorbed.values()),
                                    "per_consumer": dict(self.duplicates_absorbed)},
            "reconciled": self.reconciled,
            "batches": self.batches,
            "counters": {c: dict(v) for c, v in self.counters.items()},
            "vacuum": None if self.vacuum is None else self.vacuum.to_dict(),
            "partitions": None if self.partitions is None else self.partitions.to_dict(),
        }


def _pending_where(tables: Tables) -> tuple[sa.ColumnElement[bool], ...]:
    return (tables.outbox.published_at_ms.is_(None), tables.outbox.dead_lettered_at_ms.is_(None))


def claim_held_ms(session: Session, *, tables: Tables) -> int | None:
    """How long the oldest open claim on the outbox table has been held, in ms (None: no claim open).

    Postgres only: a claim is the relay's ``SELECT ... FOR UPDATE SKIP LOCKED`` (relay/queries.py), which
    holds a ``RowShareLock`` on the table until the batch's mark commits; nothing else in the library keeps
    one open for longer than a statement or two. ``pg_locks`` and ``pg_stat_activity`` are small in-memory
    views, so this costs one short query a scrape. Sessions of other database roles show no start time
    without ``pg_read_all_stats`` and are not counted. On SQLite the relay's claim is committed before the
    publish (a single-flight file lock serialises the relays instead), so there is never one to report.
    """
    bind = session.get_bind()
    if bind.dialect.name != "postgresql":
        return None
    held = session.execute(sa.text(
        "SELECT (extract(epoch FROM clock_timestamp() - min(a.xact_start)) * 1000)::bigint "
        "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'relation' AND l.relation = to_regclass(:table) AND l.mode = 'RowShareLock' "
        "AND l.granted AND l.pid <> pg_backend_pid()"
    ), {"table": tables.table(tables.outbox).fullname}).scalar()
    return None if held is None else max(0, int(held))


# Sessions of this database (and walsenders, whose hot_standby_feedback holds every database) that hold back
# the oldest xid vacuum may clean: a snapshot (backend_xmin) or an xid of their own (backend_xid). Autovacuum
# workers are left out (a vacuum's own snapshot does not hold back other vacuums), and so is this session.
# Other roles' sessions show no xmin without pg_read_all_stats.
_HOLDERS_SQL = """
SELECT pid, application_name, state, backend_type,
       greatest(age(backend_xmin), age(backend_xid)) AS xids,
       (extract(epoch FROM clock_timestamp() - xact_start) * 1000)::bigint AS open_ms
FROM pg_stat_activity
WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) AND pid <> pg_backend_pid()
  AND backend_type NOT IN ('autovacuum worker', 'autovacuum launcher')
  AND (datname = current_database() OR backend_type = 'walsender')
UNION ALL
SELECT NULL, gid, 'prepared', 'prepared transaction', age(transaction),
       (extract(epoch FROM clock_timestamp() - prepared) * 1000)::bigint
FROM pg_prepared_xacts WHERE database = current_database()
"""
_SLOTS_SQL = ("SELECT slot_name, active, age(xmin), age(catalog_xmin) FROM pg_replication_slots "
              "WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL ORDER BY slot_name")
# Summed over each table's partition tree: a partitioned outbox (docs/partitioning.md) keeps its tuples in its
# partitions, and its own row in pg_stat_user_tables reads 0 (pg_partition_tree lists nothing for a plain table).
_TABLES_SQL = """
SELECT r.name, sum(s.n_dead_tup), sum(s.n_live_tup), (extract(epoch FROM max(s.last_autovacuum)) * 1000)::bigint,
       (extract(epoch FROM max(s.last_vacuum)) * 1000)::bigint
FROM (VALUES (:outbox_name, to_regclass(:outbox)), (:inbox_name, to_regclass(:inbox))) AS r(name, root)
CROSS JOIN LATERAL (SELECT r.root AS relid UNION SELECT relid FROM pg_partition_tree(r.root)) AS t
JOIN pg_stat_user_tables s ON s.relid = t.relid
GROUP BY r.name
"""


def vacuum_stats(session: Session, *, tables: Tables) -> VacuumStats | None:
    """What holds back vacuum and the outbox and inbox tables' dead tuples (None off Postgres, or when the views
    cannot be read: the rest of the stats still can). Reads small in-memory views (pg_stat_activity,
    pg_prepared_xacts, pg_replication_slots, pg_stat_user_tables), in a savepoint."""
    if session.get_bind().dialect.name != "postgresql":
        return None
    try:
        with session.begin_nested():
            return _vacuum_stats(session, tables=tables)
    except exc.DBAPIError as e:
        log.warning("stats: cannot read the vacuum views: %s", e.orig)
        return None


def partition_headroom(session: Session, *, tables: Tables) -> Headroom | None:
    """The partitioned layout's headroom (None on the plain layout, on SQLite, or when the catalog cannot be
    read: logged, the rest of the stats still can), in a savepoint."""
    if session.get_bind().dialect.name != "postgresql":
        return None
    try:
        with session.begin_nested():
            return partitions.headroom(session, tables=tables)
    except (exc.DBAPIError, ConfigError) as e:
        log.warning("stats: cannot read the outbox table's partitions: %s", getattr(e, "orig", None) or e)
        return None


def _vacuum_stats(session: Session, *, tables: Tables) -> VacuumStats:
    holders = session.execute(sa.text(_HOLDERS_SQL)).all()
    oldest = max(holders, key=lambda h: h.xids or 0, default=None)
    who = None
    if oldest is not None:
        who = (f"prepared transaction {oldest.application_name!r}" if oldest.pid is None else
               f"pid {oldest.pid} {oldest.application_name or oldest.backend_type} ({oldest.state or 'active'})")
    slots = [SlotHorizon(slot=str(name), active=bool(active), xmin_age_xids=None if x is None else int(x),
                         catalog_xmin_age_xids=None if c is None else int(c))
             for name, active, x, c in session.execute(sa.text(_SLOTS_SQL))]
    names = [tables.table(tables.outbox).name, tables.table(tables.inbox).name]
    found = {str(r[0]): r for r in session.execute(sa.text(_TABLES_SQL), {
        "outbox": f'"{names[0]}"', "inbox": f'"{names[1]}"', "outbox_name": names[0], "inbox_name": names[1]})}
    stats = [TableVacuumStats(table=n, dead_tuples=int(found[n][1]), live_tuples=int(found[n][2]),
                              last_autovacuum_ms=None if found[n][3] is None else int(found[n][3]),
                              last_vacuum_ms=None if found[n][4] is None else int(found[n][4]))
             for n in names if n in found]
    open_ms = [int(h.open_ms) for h in holders if h.open_ms is not None]
    return VacuumStats(
        oldest_xact_age_xids=None if oldest is None or oldest.xids is None else int(oldest.xids),
        oldest_xact_age_ms=max(0, max(open_ms)) if open_ms else None, oldest_xact=who, slots=slots, tables=stats)


def collect(session: Session, *, tables: Tables, clock: Clock) -> Stats:
    now = clock.now_ms()
    o = tables.outbox
    # A row that never failed waits from its next_attempt_at_ms: its creation, its eta (held, docs/scheduled.md),
    # or the replay that put it back. Before then it is scheduled, not a backlog. A row that failed waits from
    # its creation or its eta, even while it backs off (it is late, and stays in the figure).
    fresh, failed = o.attempts == 0, o.attempts > 0
    # a row held for a worker (held_for) is not scheduled: it is counted in waiting_for_worker
    scheduled = sa.and_(fresh, o.next_attempt_at_ms > now, o.held_for.is_(None))
    held_until = sa.cast(o.headers["held_until_ms"].as_string(), sa.BigInteger)  # BIGINT: ms do not fit an int
    pending_q = sa.select(
        sa.func.count(),
        sa.func.count().filter(o.next_attempt_at_ms <= now),
        sa.func.count().filter(failed),
        sa.func.min(o.next_attempt_at_ms).filter(o.next_attempt_at_ms <= now),
        sa.func.min(o.next_attempt_at_ms).filter(fresh, o.next_attempt_at_ms <= now),
        sa.func.min(sa.func.coalesce(held_until, o.created_at_ms)).filter(failed),
        sa.func.count().filter(scheduled),
        sa.func.min(o.next_attempt_at_ms).filter(scheduled),
    ).select_from(o).where(*_pending_where(tables))
    (pending, due, retrying, first_due, fresh_since, failed_since, held, next_held) = session.execute(pending_q).one()
    waiting = [int(t) for t in (fresh_since, failed_since) if t is not None]
    held_q = (sa.select(o.held_for, sa.func.count(), sa.func.min(o.created_at_ms))
              .where(*_pending_where(tables), o.held_for.is_not(None)).group_by(o.held_for).order_by(o.held_for))
    waiting_for_worker = [WaitingForWorker(what=str(what).removeprefix("waiting for a worker that runs "),
                                           count=int(n), oldest_age_ms=max(0, now - int(oldest)))
                          for what, n, oldest in session.execute(held_q)]
    published = session.scalar(
        sa.select(sa.func.count()).select_from(tables.outbox).where(tables.outbox.published_at_ms.is_not(None))
    ) or 0

    groups: list[DeadLetterGroup] = []
    o_count, o_oldest = session.execute(
        sa.select(sa.func.count(), sa.func.min(tables.outbox.dead_lettered_at_ms))
        .where(tables.outbox.dead_lettered_at_ms.is_not(None))
    ).one()
    if o_count:
        groups.append(DeadLetterGroup(source="outbox", consumer=None, count=int(o_count),
                                      oldest_age_ms=max(0, now - int(o_oldest or now))))
    for consumer, count, oldest in session.execute(
        sa.select(tables.dead_letters.consumer, sa.func.count(), sa.func.min(tables.dead_letters.last_failed_at_ms))
        .where(tables.dead_letters.replayed_at_ms.is_(None))
        .group_by(tables.dead_letters.consumer).order_by(tables.dead_letters.consumer)
    ):
        groups.append(DeadLetterGroup(source="consumer", consumer=consumer, count=int(count),
                                      oldest_age_ms=max(0, now - int(oldest or now))))

    inbox = {c: int(n) for c, n in session.execute(
        sa.select(tables.inbox.consumer, sa.func.count()).group_by(tables.inbox.consumer).order_by(tables.inbox.consumer)
    )}
    counters = relay_counters.fold((c, n, v) for c, n, v in session.execute(  # stripes added up (counters.py)
        sa.select(tables.counters.consumer, tables.counters.name, tables.counters.value)
        .order_by(tables.counters.consumer, tables.counters.name)
    ))
    duplicates = {c: v[relay_counters.DUPLICATES] for c, v in counters.items() if relay_counters.DUPLICATES in v}
    return Stats(
        now_ms=now, pending=int(pending), due=int(due), retrying=int(retrying),
        oldest_pending_age_ms=max(0, now - min(waiting)) if waiting else None,
        published=int(published), oldest_overdue_ms=None if first_due is None else max(0, now - int(first_due)),
        scheduled=int(held), next_due_at_ms=None if next_held is None else int(next_held),
        claim_held_ms=claim_held_ms(session, tables=tables),
        waiting_for_worker=waiting_for_worker,
        dead_letters=groups, inbox=inbox, duplicates_absorbed=duplicates,
        counters=counters,
        vacuum=vacuum_stats(session, tables=tables),
        partitions=partition_headroom(session, tables=tables),
    )
