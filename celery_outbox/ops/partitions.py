"""The optional partitioned outbox layout (Postgres): the outbox table partitioned by ``seq`` range, so
retention drops a whole old partition instead of deleting its rows one by one (docs/partitioning.md).

Why ``seq`` and not a day: ``seq`` is already the primary key, so the key (and every lookup by it: the
relay's ``UPDATE ... WHERE seq = ANY(:ids)``, the dead-letter commands) stays as it is and each such
statement touches one partition; a time key would have to join the primary key. Rows arrive in ``seq``
order, so a range of ``seq`` is also a range of time.

What Postgres cannot do on a partitioned table is a unique index without the partition key, so:

- ``message_id``: a unique index on every partition plus a ``BEFORE INSERT`` trigger (the reused-id
  check) that refuses an id any partition already holds, with the same SQLSTATE (23505) the plain
  table's constraint raises.
- ``dedup_key``: a unique partial index on every partition; ``INSERT ... ON CONFLICT (dedup_key)``
  (celery_outbox/dedup.py) cannot name a per-partition index, so dedup by key is not available on this
  layout (the write fails, nothing is written): docs/partitioning.md, "Limits".

The layout is recognised by the catalog (the outbox table's ``relkind`` is ``p``), never by a setting:
SQLite and the plain table stay the default and unchanged. Partitions are created ahead by
``ensure_partitions`` (run by ``outbox prune`` and ``outbox db partitions ensure``).

Locks: after the conversion nothing here takes ACCESS EXCLUSIVE on the outbox table. A pipelined relay
under backlog always has a batch transaction open that waits for its next claim, which would queue behind
that lock: an application-level deadlock that only ``lock_timeout`` ends (bench/partitioned_retention.py
found it). So a new partition is built on its own and ATTACHed (SHARE UPDATE EXCLUSIVE on the parent), and
an expired one is DETACHed CONCURRENTLY (the same) and then dropped. Both need the table to have no
DEFAULT partition; the partitions ahead are what keeps writes from failing (docs/partitioning.md).

One module, though long: the conversion, the partitions ahead and the detach and drop of old ones keep the one
lock discipline above together; apart, one of them could take the lock the others are written to avoid.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import autovacuum
from celery_outbox.clock import Clock
from celery_outbox.db import is_postgres, wrap_driver_errors
from celery_outbox.errors import ConfigError, ValidationError
from celery_outbox.layout import is_partitioned
from celery_outbox.schema import DEAD_SQL, PENDING_SQL, Tables

log = logging.getLogger(__name__)

DEFAULT_SIZE = 1_000_000  # rows per partition: about a day at 12 rows/s; docs/partitioning.md, "Sizing"
DEFAULT_AHEAD = 4
MAX_AHEAD = 1000
# Rows per partition at most: ``MAX_AHEAD`` partitions of it above any seq stay far inside BIGINT (past it a range's
# bound was a database error, "bigint out of range", after the command had started).
MAX_SIZE = 10**12
DEFAULT_LOCK_TIMEOUT_MS = 5000
_BOUND = re.compile(r"FOR VALUES FROM \((MINVALUE|'?-?\d+'?)\) TO \((MAXVALUE|'?-?\d+'?)\)")


@dataclass(frozen=True, kw_only=True)
class Partition:
    """One partition of the outbox table: ``seq`` in ``[lower, upper)`` (None: unbounded), or the default."""

    name: str
    lower: int | None
    upper: int | None
    default: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "lower": self.lower, "upper": self.upper, "default": self.default}


@dataclass(frozen=True, kw_only=True)
class PartitionState:
    """What keeps a partition (or lets it go): its rows by state, newest publish and dead-letter times."""

    partition: Partition
    rows: int
    pending: bool
    dead: int
    newest_published_ms: int | None
    newest_dead_ms: int | None
    closed: bool  # no new row can be written into it (its range is below the next seq)

    def blocker(self, *, published_before_ms: int, dead_before_ms: int | None) -> str | None:
        """Why this partition must stay (None: every row is published or dead and past retention)."""
        if not self.closed:
            return "still receiving rows"
        if self.pending:
            return "holds pending rows"
        if self.newest_published_ms is not None and self.newest_published_ms >= published_before_ms:
            return "holds rows published after the cutoff"
        if self.dead:
            if dead_before_ms is None:
                return f"holds {self.dead} dead-lettered row(s) (give a dead-letter age to drop them)"
            if self.newest_dead_ms is not None and self.newest_dead_ms >= dead_before_ms:
                return "holds rows dead-lettered after the dead-letter cutoff"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {**self.partition.to_dict(), "rows": self.rows, "pending": self.pending, "dead": self.dead,
                "newest_published_ms": self.newest_published_ms, "newest_dead_ms": self.newest_dead_ms,
                "closed": self.closed}


@dataclass(frozen=True, kw_only=True)
class ConvertReport:
    table: str
    boundary: int  # the plain table became the partition seq < boundary
    size: int
    created: tuple[str, ...]
    validate_s: float  # the CHECK's validation scan, under SHARE UPDATE EXCLUSIVE (writes go on)
    lock_s: float  # the swap: ACCESS EXCLUSIVE on the outbox table, from granted to commit

    def to_dict(self) -> dict[str, Any]:
        return {"table": self.table, "boundary": self.boundary, "size": self.size, "created": list(self.created),
                "validate_s": round(self.validate_s, 4), "lock_s": round(self.lock_s, 4)}


@dataclass(frozen=True, kw_only=True)
class DropReport:
    dropped: tuple[str, ...] = ()
    rows: int = 0  # rows the dropped partitions held
    kept: dict[str, str] = field(default_factory=dict)  # partition -> why it stays
    lock_s: tuple[float, ...] = ()  # per drop: DETACH CONCURRENTLY to DROP (no lock that blocks the relay)

    def to_dict(self) -> dict[str, Any]:
        return {"dropped": list(self.dropped), "rows": self.rows, "kept": dict(self.kept),
                "lock_s": [round(x, 4) for x in self.lock_s]}


def _table(tables: Tables) -> str:
    return tables.table(tables.outbox).name  # the prefix is checked: lower-case letters, digits, '_'


def _require_postgres(session: Session) -> None:
    if not is_postgres(session):
        raise ConfigError("the partitioned outbox layout needs Postgres (SQLite keeps the plain table)")


@contextmanager
def _session(session_factory: sessionmaker[Session], what: str) -> Iterator[Session]:
    with session_factory() as session, wrap_driver_errors(what):
        _require_postgres(session)
        yield session


def _parse(name: str, bound: str) -> Partition:
    if bound == "DEFAULT":
        return Partition(name=name, lower=None, upper=None, default=True)
    m = _BOUND.search(bound)
    if m is None:
        raise ConfigError(f"partition {name} has a bound this library did not create: {bound}")
    lo, hi = (None if v.endswith("VALUE") else int(v.strip("'")) for v in m.groups())
    return Partition(name=name, lower=lo, upper=hi)


def list_partitions(session: Session, *, tables: Tables) -> list[Partition]:
    """The outbox table's partitions, lowest ``seq`` first, the default partition last."""
    rows = session.execute(sa.text(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(:t)"), {"t": _table(tables)}).all()
    parts = [_parse(r[0], r[1]) for r in rows]
    return sorted(parts, key=lambda p: (p.default, p.lower if p.lower is not None else -(2**63)))


def _next_seq(session: Session, table: str) -> int:
    """The seq the next insert gets (the identity sequence's next value, without taking it)."""
    seq_name = session.execute(sa.text("SELECT pg_get_serial_sequence(:t, 'seq')"), {"t": table}).scalar()
    if seq_name is None:
        raise ConfigError(f"{table}.seq has no identity sequence: not a table this library created")
    # The sequence's own row: pg_sequence_last_value() is NULL after a RESTART, when the next value is last_value.
    last, called = session.execute(sa.text(f"SELECT last_value, is_called FROM {seq_name}")).one()
    return int(last) + 1 if called else int(last)


def _ddl(session: Session, tables: Tables, index: sa.Index, on: str | None = None) -> str:
    """The library's own index definition (schema.py), compiled for Postgres, optionally onto another table."""
    sql = str(sa.schema.CreateIndex(index).compile(dialect=session.get_bind().dialect))
    if on is not None:
        sql = sql.replace(f" ON {_table(tables)} ", f" ON {on} ", 1)
    return sql


def _partition_indexes(session: Session, tables: Tables, part: str) -> None:
    """The unique indexes a partitioned parent cannot hold, on one partition (docs/partitioning.md)."""
    session.execute(sa.text(f"CREATE UNIQUE INDEX ON {part} (message_id)"))
    for index in tables.table(tables.outbox).indexes:
        if index.unique:  # ux_<prefix>dedup: same definition, auto-named per partition
            sql = _ddl(session, tables, index, on=part).replace(f"INDEX {index.name} ON", "INDEX ON", 1)
            session.execute(sa.text(sql))


def _create_range(session: Session, tables: Tables, lower: int, upper: int) -> str:
    """A new empty table with the partition's CHECK and indexes, then ATTACH: SHARE UPDATE EXCLUSIVE on the
    parent (the relay's claims and marks go on), the CHECK spares the scan, the indexes are attached."""
    table = _table(tables)
    name = f"{table}_p{lower}"
    session.execute(sa.text(f"CREATE TABLE {name} (LIKE {table} INCLUDING DEFAULTS INCLUDING STORAGE)"))
    session.execute(sa.text(f"ALTER TABLE {name} ADD CONSTRAINT {name}_range "
                            f"CHECK (seq IS NOT NULL AND seq >= {lower} AND seq < {upper})"))
    session.execute(sa.text(f"ALTER TABLE {name} ADD PRIMARY KEY (seq)"))
    for index in tables.table(tables.outbox).indexes:
        if not index.unique:
            sql = _ddl(session, tables, index, on=name).replace(f"INDEX {index.name} ON", "INDEX ON", 1)
            session.execute(sa.text(sql))
    _partition_indexes(session, tables, name)
    # A partitioned parent takes no autovacuum settings: each partition gets co0007's (docs/operations.md).
    session.execute(sa.text(autovacuum.set_sql(name, autovacuum.server_version_num(session.connection()))))
    session.execute(sa.text(f"ALTER TABLE {table} ATTACH PARTITION {name} FOR VALUES FROM ({lower}) TO ({upper})"))
    return name


def _rename_aside(session: Session, table: str, to: str, suffix: str) -> None:
    """Rename ``table`` to ``to`` and its indexes to ``<name>_<suffix>`` (cut to Postgres' 63 characters), so
    the library's names are free for the table that takes its place (convert and revert)."""
    indexes = session.execute(sa.text(
        "SELECT i.relname FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
        "WHERE x.indrelid = to_regclass(:t)"), {"t": table}).scalars().all()
    session.execute(sa.text(f"ALTER TABLE {table} RENAME TO {to}"))
    for name in indexes:
        session.execute(sa.text(f"ALTER INDEX {name} RENAME TO {name[:62 - len(suffix)]}_{suffix}"))


def _lock(session: Session, table: str, lock_timeout_ms: int) -> None:
    session.execute(sa.text(f"SET LOCAL lock_timeout = {int(lock_timeout_ms)}"))
    session.execute(sa.text(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))


def _trigger_names(tables: Tables) -> tuple[str, str]:
    """(the NOTIFY trigger of migration 0001, the reused-id check of this layout)."""
    return f"{tables.prefix}notify", f"{tables.prefix}message_id_unique"


def _has_trigger(session: Session, table: str, name: str) -> bool:
    return session.execute(sa.text(
        "SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass(:t) AND tgname = :n"), {"t": table, "n": name}
    ).first() is not None


def _check_size(size: int, ahead: int, lock_timeout_ms: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or not 1000 <= size <= MAX_SIZE:
        raise ConfigError(f"partition size must be a whole number of rows, 1000..{MAX_SIZE}, got {size!r}")
    if isinstance(ahead, bool) or not isinstance(ahead, int) or not 1 <= ahead <= MAX_AHEAD:
        raise ConfigError(f"partitions ahead must be 1..{MAX_AHEAD}, got {ahead!r}")
    if isinstance(lock_timeout_ms, bool) or not isinstance(lock_timeout_ms, int) or lock_timeout_ms < 1:
        raise ConfigError(f"lock timeout must be >= 1 ms, got {lock_timeout_ms!r}")


def convert(session_factory: sessionmaker[Session], *, tables: Tables, size: int = DEFAULT_SIZE,
            ahead: int = DEFAULT_AHEAD, lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
            reused_id_check: bool = True) -> ConvertReport:
    """Turn the live plain outbox table into a table partitioned by ``seq`` range, without copying a row.

    1. ``CHECK (seq < boundary) NOT VALID`` (a brief ACCESS EXCLUSIVE), boundary one partition above the
       next seq; ``VALIDATE`` scans under SHARE UPDATE EXCLUSIVE, so writes and the relay go on.
    2. One transaction under ACCESS EXCLUSIVE (``lock_timeout`` bounded, so it never queues the relay
       behind a long transaction): rename the table and its indexes, create the partitioned parent with
       the library's indexes, ATTACH the old table as the partition ``seq < boundary`` (the valid CHECK
       proves the bound: no scan; its indexes match the parent's: no build), create ``ahead`` empty
       partitions, move the NOTIFY trigger, add the reused-id check.
    The old table's rows keep their seq; new rows start at the boundary, in the first new partition.
    ``reused_id_check=False`` leaves ``message_id`` unique per partition only (one index probe per insert
    instead of one per partition; docs/partitioning.md weighs it).
    """
    _check_size(size, ahead, lock_timeout_ms)
    table = _table(tables)
    old = f"{table}_plain"
    check = f"{table}_seq_below"
    with _session(session_factory, f"converting {table} to partitions") as s:
        if s.execute(sa.text("SELECT to_regclass(:t)"), {"t": table}).scalar() is None:
            raise ConfigError(f"{table} does not exist: run `outbox db upgrade` first")
        if is_partitioned(s, tables=tables):
            raise ConfigError(f"{table} is already partitioned (see `outbox db partitions status`)")
        if s.execute(sa.text("SELECT to_regclass(:t)"), {"t": old}).scalar() is not None:
            raise ConfigError(f"{old} exists already (a half-done conversion?): rename or drop it first")
        boundary = (_next_seq(s, table) // size + 2) * size
        _lock(s, table, lock_timeout_ms)
        s.execute(sa.text(f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {check}"))
        s.execute(sa.text(f"ALTER TABLE {table} ADD CONSTRAINT {check} CHECK (seq IS NOT NULL AND seq < {boundary}) "
                          "NOT VALID"))
        s.commit()
        t0 = time.perf_counter()
        s.execute(sa.text("SET LOCAL statement_timeout = 0"))
        s.execute(sa.text(f"ALTER TABLE {table} VALIDATE CONSTRAINT {check}"))
        s.commit()
        validate_s = time.perf_counter() - t0

        _lock(s, table, lock_timeout_ms)
        t0 = time.perf_counter()
        notify, unique = _trigger_names(tables)
        had_notify = _has_trigger(s, table, notify)
        _rename_aside(s, table, old, "plain")
        if had_notify:
            s.execute(sa.text(f"DROP TRIGGER {notify} ON {old}"))
        s.execute(sa.text(
            f"CREATE TABLE {table} (LIKE {old} INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING STORAGE) "
            "PARTITION BY RANGE (seq)"))
        s.execute(sa.text(f"ALTER TABLE {table} ALTER COLUMN seq RESTART WITH {boundary}"))
        s.execute(sa.text(f"ALTER TABLE {table} ADD PRIMARY KEY (seq)"))
        for index in tables.table(tables.outbox).indexes:
            if not index.unique:
                s.execute(sa.text(_ddl(s, tables, index)))
        s.execute(sa.text(f"ALTER TABLE {table} ATTACH PARTITION {old} FOR VALUES FROM (MINVALUE) TO ({boundary})"))
        created = [_create_range(s, tables, boundary + k * size, boundary + (k + 1) * size) for k in range(ahead)]
        if reused_id_check:
            _reused_id_check(s, table, unique)
        if had_notify:
            s.execute(sa.text(f"CREATE TRIGGER {notify} AFTER INSERT ON {table} FOR EACH STATEMENT "
                              f"EXECUTE FUNCTION {notify}()"))
        s.commit()
        lock_s = time.perf_counter() - t0
    report = ConvertReport(table=table, boundary=boundary, size=size, created=tuple(created), validate_s=validate_s,
                           lock_s=lock_s)
    log.info("converted %s", report.to_dict())
    return report


def _reused_id_check(s: Session, table: str, unique: str) -> None:
    """The trigger that refuses a message_id any partition holds (SQLSTATE 23505, as the plain table)."""
    s.execute(sa.text(
        f"CREATE OR REPLACE FUNCTION {unique}() RETURNS trigger AS $$ BEGIN "
        f"IF EXISTS (SELECT 1 FROM {table} WHERE message_id = NEW.message_id) THEN "
        f"RAISE EXCEPTION 'duplicate key value violates unique constraint \"{table}_message_id_key\"' "
        "USING ERRCODE = 'unique_violation', DETAIL = format('Key (message_id)=(%s) already exists.', "
        "NEW.message_id); END IF; RETURN NEW; END $$ LANGUAGE plpgsql"))
    s.execute(sa.text(f"CREATE TRIGGER {unique} BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION {unique}()"))


def _size_of(parts: list[Partition]) -> int:
    ranges = [p for p in parts if not p.default and p.lower is not None and p.upper is not None]
    if not ranges:
        raise ConfigError("the outbox table has no range partition this library created; cannot tell the size")
    return ranges[-1].upper - ranges[-1].lower  # type: ignore[operator]


def ensure_partitions(session_factory: sessionmaker[Session], *, tables: Tables, ahead: int = DEFAULT_AHEAD,
                      lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> tuple[str, ...]:
    """Create empty partitions until ``ahead`` of them lie above the next seq; returns their names.

    Each is built on its own and ATTACHed (SHARE UPDATE EXCLUSIVE on the outbox table, ``lock_timeout``
    bounded): the relay and writers go on meanwhile.
    """
    _check_size(DEFAULT_SIZE, ahead, lock_timeout_ms)
    table = _table(tables)
    with _session(session_factory, f"creating partitions of {table}") as s:
        if not is_partitioned(s, tables=tables):
            raise ConfigError(f"{table} is not partitioned (run `outbox db partitions convert` first)")
        parts = list_partitions(s, tables=tables)
        size = _size_of(parts)
        top = max(p.upper for p in parts if p.upper is not None)
        want = _next_seq(s, table) + ahead * size
        if top >= want:
            return ()
        s.execute(sa.text(f"SET LOCAL lock_timeout = {int(lock_timeout_ms)}"))
        created = []
        while top < want:
            created.append(_create_range(s, tables, top, top + size))
            top += size
        s.commit()
    log.info("created partitions %s", created)
    return tuple(created)


@dataclass(frozen=True, kw_only=True)
class Headroom:
    """How many more rows the outbox table takes before a write fails for want of a partition (there is no
    DEFAULT partition: "Partitions ahead" in docs/partitioning.md). ``ahead`` is that in partitions of the
    newest partition's size, the figure the prune keeps at ``--ahead``: it falls only when no prune runs."""

    rows: int
    partition_size: int

    @property
    def ahead(self) -> float:
        return self.rows / self.partition_size if self.partition_size > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "partition_size": self.partition_size, "ahead": round(self.ahead, 3)}


def headroom(session: Session, *, tables: Tables) -> Headroom | None:
    """The partitioned layout's headroom (None on the plain layout or SQLite). Catalog reads and the
    sequence's own row: cheap enough for every metrics scrape."""
    if not is_partitioned(session, tables=tables):
        return None
    ranges = [p for p in list_partitions(session, tables=tables) if not p.default and p.upper is not None]
    if not ranges:
        return Headroom(rows=0, partition_size=0)
    top = ranges[-1]
    size = top.upper - top.lower if top.lower is not None and top.upper is not None else 0
    return Headroom(rows=max(0, int(top.upper or 0) - _next_seq(session, _table(tables))), partition_size=max(0, size))


def _state(session: Session, part: Partition, next_seq: int, *, rows: int | None = None) -> PartitionState:
    """Index reads only (ix_pending, ix_dead, ix_published of the partition), plus a row count (a scan)
    unless ``rows`` is given: the re-check under the lock must not scan."""
    name = part.name
    pending = session.execute(sa.text(f"SELECT 1 FROM {name} WHERE {PENDING_SQL} LIMIT 1")).first() is not None
    dead, newest_dead = session.execute(sa.text(
        f"SELECT count(*), max(dead_lettered_at_ms) FROM {name} WHERE {DEAD_SQL}")).one()
    newest = session.execute(sa.text(
        f"SELECT max(published_at_ms) FROM {name} WHERE published_at_ms IS NOT NULL")).scalar()
    if rows is None:
        rows = int(session.execute(sa.text(f"SELECT count(*) FROM {name}")).scalar_one())
    closed = part.upper is not None and part.upper <= next_seq
    return PartitionState(partition=part, rows=int(rows), pending=pending, dead=int(dead),
                          newest_published_ms=None if newest is None else int(newest),
                          newest_dead_ms=None if newest_dead is None else int(newest_dead), closed=closed)


def status(session_factory: sessionmaker[Session], *, tables: Tables) -> list[PartitionState]:
    """Every partition with what it holds (rows counted: a scan of each; an operator's command)."""
    table = _table(tables)
    with _session(session_factory, f"reading the partitions of {table}") as s:
        if not is_partitioned(s, tables=tables):
            raise ConfigError(f"{table} is not partitioned (the plain layout; docs/partitioning.md)")
        next_seq = _next_seq(s, table)
        return [_state(s, p, next_seq) for p in list_partitions(s, tables=tables)]


def _detach_and_drop(session_factory: sessionmaker[Session], tables: Tables, part: Partition, lock_timeout_ms: int,
                     kept: dict[str, str]) -> float | None:
    """DETACH CONCURRENTLY (its own transactions: SHARE UPDATE EXCLUSIVE on the parent, it waits for the
    relay's open transactions instead of blocking them), then look at the detached table, which nothing
    can write any more: a pending row there (a dead row replayed between the first look and the detach)
    sends it back with ATTACH; otherwise DROP. Returns the seconds from DETACH to DROP, None when kept."""
    table = _table(tables)
    bind = session_factory.kw.get("bind")
    if not isinstance(bind, sa.Engine):
        raise ConfigError("dropping partitions needs a sessionmaker bound to an Engine (DETACH CONCURRENTLY "
                          "runs outside a transaction, on a connection of its own)")
    t0 = time.perf_counter()
    with bind.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        pending_detach = c.exec_driver_sql(
            "SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass(%(p)s)", {"p": part.name}).scalar()
        try:
            c.exec_driver_sql(f"SET lock_timeout = {int(lock_timeout_ms)}")
            # An earlier run interrupted mid-detach (its wait timed out) left it half detached: finish that.
            how = "FINALIZE" if pending_detach else "CONCURRENTLY"
            c.exec_driver_sql(f"ALTER TABLE {table} DETACH PARTITION {part.name} {how}")
        except sa.exc.OperationalError as e:
            kept[part.name] = f"not detached: {type(e.orig).__name__} (the next run tries again)"
            log.warning("partition %s not detached: %s", part.name, e.orig)
            return None
        pending = c.exec_driver_sql(f"SELECT 1 FROM {part.name} WHERE {PENDING_SQL} LIMIT 1").first()
        if pending is not None:
            bound = f"FROM ({'MINVALUE' if part.lower is None else part.lower}) TO ({part.upper})"
            c.exec_driver_sql(f"ALTER TABLE {table} ATTACH PARTITION {part.name} FOR VALUES {bound}")
            kept[part.name] = "a row became pending while it was detached: attached again"
            return None
        c.exec_driver_sql(f"DROP TABLE {part.name}")
    return time.perf_counter() - t0


def drop_expired(session_factory: sessionmaker[Session], *, tables: Tables, published_older_than_ms: int,
                 dead_older_than_ms: int | None = None, clock: Clock,
                 lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> DropReport:
    """Drop every closed partition whose rows are all published (or dead) before the cutoffs.

    Never a partition that may still get a row (its range reaches the next seq), nor one holding a
    pending row. Dead-lettered rows keep their partition unless ``dead_older_than_ms`` is given (the
    plain layout never deletes them either). Each drop is DETACH CONCURRENTLY, a last look at the detached
    table, then DROP (``_detach_and_drop``): catalog work, no row is written, the relay is not blocked.
    The inbox is not touched.
    """
    for name, value in (("published age", published_older_than_ms), ("dead-letter age", dead_older_than_ms)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValidationError(f"{name} must be >= 0 ms, got {value!r}")
    _check_size(DEFAULT_SIZE, DEFAULT_AHEAD, lock_timeout_ms)
    table = _table(tables)
    now = clock.now_ms()
    published_before = now - published_older_than_ms
    dead_before = None if dead_older_than_ms is None else now - dead_older_than_ms
    dropped: list[str] = []
    kept: dict[str, str] = {}
    locks: list[float] = []
    rows = 0
    with _session(session_factory, f"dropping expired partitions of {table}") as s:
        if not is_partitioned(s, tables=tables):
            raise ConfigError(f"{table} is not partitioned (the plain layout prunes with DELETE)")
        next_seq = _next_seq(s, table)
        candidates = []
        for part in list_partitions(s, tables=tables):
            state = _state(s, part, next_seq)
            why = state.blocker(published_before_ms=published_before, dead_before_ms=dead_before)
            if why is None and part.default:
                why = "a DEFAULT partition (not created by this library) is never dropped"
            if why is None:
                candidates.append(state)
            else:
                kept[part.name] = why
        s.rollback()
    for state in candidates:
        part = state.partition
        took = _detach_and_drop(session_factory, tables, part, lock_timeout_ms, kept)
        if took is not None:
            locks.append(took)
            dropped.append(part.name)
            rows += state.rows
    report = DropReport(dropped=tuple(dropped), rows=rows, kept=kept, lock_s=tuple(locks))
    log.info("dropped partitions %s", report.to_dict())
    return report


def revert(session_factory: sessionmaker[Session], *, tables: Tables,
           lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> float:
    """Back to the plain table: copy every row into a fresh plain table under ACCESS EXCLUSIVE (writes and
    the relay wait for the copy: prune first so little is left), then drop the partitions. Returns the
    seconds the lock was held."""
    if isinstance(lock_timeout_ms, bool) or not isinstance(lock_timeout_ms, int) or lock_timeout_ms < 1:
        raise ConfigError(f"lock timeout must be >= 1 ms, got {lock_timeout_ms!r}")
    table = _table(tables)
    gone = f"{table}_partitioned"
    notify, unique = _trigger_names(tables)
    columns = ", ".join(c.name for c in tables.table(tables.outbox).columns)
    with _session(session_factory, f"reverting {table} to the plain layout") as s:
        if not is_partitioned(s, tables=tables):
            raise ConfigError(f"{table} is not partitioned: nothing to revert")
        _lock(s, table, lock_timeout_ms)
        t0 = time.perf_counter()
        s.execute(sa.text("SET LOCAL statement_timeout = 0"))
        next_seq = _next_seq(s, table)
        had_notify = _has_trigger(s, table, notify)
        _rename_aside(s, table, gone, "partitioned")
        tables.table(tables.outbox).create(s.connection())
        s.execute(sa.text(autovacuum.set_sql(table, autovacuum.server_version_num(s.connection()))))
        s.execute(sa.text(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM {gone} ORDER BY seq"))
        s.execute(sa.text(f"ALTER TABLE {table} ALTER COLUMN seq RESTART WITH {next_seq}"))
        if had_notify:
            s.execute(sa.text(f"CREATE TRIGGER {notify} AFTER INSERT ON {table} FOR EACH STATEMENT "
                              f"EXECUTE FUNCTION {notify}()"))
        s.execute(sa.text(f"DROP TABLE {gone} CASCADE"))
        s.execute(sa.text(f"DROP FUNCTION IF EXISTS {unique}()"))
        s.commit()
        lock_s = time.perf_counter() - t0
        s.execute(sa.text(f"ANALYZE {table}"))
        s.commit()
    log.info("reverted %s to the plain layout, lock held %.3fs", table, lock_s)
    return lock_s
