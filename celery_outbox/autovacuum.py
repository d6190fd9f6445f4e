"""Postgres autovacuum settings of the library's hot tables, and what the live database has (``outbox db check``).

The tables written and deleted at the message rate (the outbox, the inbox, task receipts, per-entity versions)
collect a dead tuple per message: the relay's mark is an UPDATE, retention a DELETE. Postgres' default
trigger waits for 20 % of the table to be dead (``autovacuum_vacuum_scale_factor`` 0.2), so the bigger the
retained history the longer the relay's claim walks dead index entries between vacuums (docs/scaling.md,
"held xmin"). Migration co0007 gives each hot table a fixed trigger instead, whatever its size: a vacuum
every ``VACUUM_THRESHOLD`` dead tuples (and an analyze every ``ANALYZE_THRESHOLD`` changes). The reasons
and the figures are in docs/operations.md, "Vacuum and bloat". SQLite has no autovacuum: nothing here applies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from celery_outbox.schema import Tables

# A vacuum after this many dead tuples, however big the table: at 300 msg/s about one per autovacuum_naptime
# (1 min), at 10 msg/s one per 8 min. Small enough that the relay's partial indexes stay a few pages, large
# enough that an idle table is never vacuumed for nothing (docs/operations.md, "Vacuum and bloat").
VACUUM_THRESHOLD = 5000
ANALYZE_THRESHOLD = 10000
# Postgres 13+: a vacuum after this many inserts too (the inbox and receipts are insert-mostly between
# retention runs), so pages are marked all-visible and frozen a little at a time, not in one anti-wraparound pass.
INSERT_THRESHOLD = 10000
INSERT_OPTIONS_SINCE = 130000  # server_version_num that knows autovacuum_vacuum_insert_*


def hot_tables(tables: Tables) -> tuple[str, ...]:
    """The tables updated or deleted at the message rate. Counters, workers, attempts and parked rows are small
    or change at the failure rate: the server's defaults (at least 50 dead tuples + 20 %) vacuum them often enough."""
    return tuple(tables.table(c).name for c in (tables.outbox, tables.inbox, tables.receipts, tables.entity_versions))


def options(server_version_num: int) -> dict[str, str]:
    """The storage parameters co0007 sets on each hot table, for a server of this version."""
    opts = {
        "autovacuum_vacuum_scale_factor": "0",
        "autovacuum_vacuum_threshold": str(VACUUM_THRESHOLD),
        "autovacuum_analyze_scale_factor": "0",
        "autovacuum_analyze_threshold": str(ANALYZE_THRESHOLD),
    }
    if server_version_num >= INSERT_OPTIONS_SINCE:
        opts["autovacuum_vacuum_insert_scale_factor"] = "0"
        opts["autovacuum_vacuum_insert_threshold"] = str(INSERT_THRESHOLD)
    return opts


def _quote(table: str) -> str:
    return '"' + table.replace('"', '""') + '"'


def set_sql(table: str, server_version_num: int) -> str:
    opts = ", ".join(f"{k} = {v}" for k, v in options(server_version_num).items())
    return f"ALTER TABLE {_quote(table)} SET ({opts})"


def reset_sql(table: str, server_version_num: int) -> str:
    return f"ALTER TABLE {_quote(table)} RESET ({', '.join(options(server_version_num))})"


def server_version_num(conn: sa.Connection) -> int:
    return int(conn.exec_driver_sql("SHOW server_version_num").scalar_one())


def _plain_tables(conn: sa.Connection, names: tuple[str, ...]) -> list[str]:
    """The ones that exist as ordinary tables in the search path: a partitioned parent takes no autovacuum
    settings (its partitions do, docs/operations.md "Vacuum and bloat")."""
    found: list[str] = []
    for name in names:
        kind = conn.execute(sa.text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:t)"),
                            {"t": _quote(name)}).scalar()
        if kind == "r":
            found.append(name)
    return found


def _alter_each(conn: sa.Connection, tables: Tables, sql: Callable[[str, int], str]) -> list[str]:
    if conn.dialect.name != "postgresql":
        return []
    version = server_version_num(conn)
    done = _plain_tables(conn, hot_tables(tables))
    for name in done:
        conn.exec_driver_sql(sql(name, version))
    return done


def apply(conn: sa.Connection, tables: Tables) -> list[str]:
    """Set the hot tables' autovacuum settings (Postgres; no-op elsewhere). Returns the tables it set."""
    return _alter_each(conn, tables, set_sql)


def reset(conn: sa.Connection, tables: Tables) -> list[str]:
    """Back to the server's defaults (co0007's downgrade)."""
    return _alter_each(conn, tables, reset_sql)


@dataclass(frozen=True, kw_only=True)
class TableVacuum:
    """One hot table's autovacuum settings as the live database has them."""

    table: str
    reloptions: dict[str, str]  # the table's own storage parameters (pg_class.reloptions), autovacuum ones only
    missing: dict[str, str]  # co0007's options the table does not set: option -> the server default it falls back to
    partitioned: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"table": self.table, "reloptions": dict(self.reloptions), "missing": dict(self.missing),
                "partitioned": self.partitioned}


@dataclass(frozen=True, kw_only=True)
class VacuumReport:
    autovacuum_on: bool  # the server's `autovacuum` (and `track_counts`, without which it does nothing)
    tables: list[TableVacuum] = field(default_factory=list)

    def lines(self) -> list[str]:
        """What `outbox db check` prints: the server's switch, then each table's effective settings (its own, or
        the server default it falls back to, marked)."""
        out = [f"autovacuum: {'on' if self.autovacuum_on else 'OFF'} (server)"]
        for t in self.tables:
            effective = {**{k: f"{v} (server default)" for k, v in t.missing.items()}, **t.reloptions}
            shown = " ".join(f"{k.removeprefix('autovacuum_')}={v}" for k, v in sorted(effective.items()))
            out.append(f"autovacuum {t.table}: {shown}" + (" (partitioned: set on its partitions)" if t.partitioned else ""))
        return out

    def warnings(self) -> list[str]:
        out: list[str] = []
        if not self.autovacuum_on:
            out.append("warning: autovacuum is off on this server (SHOW autovacuum / track_counts): nothing vacuums "
                       "the outbox tables, dead tuples and index bloat grow until a manual VACUUM "
                       "(docs/operations.md, 'Vacuum and bloat')")
        for t in self.tables:
            if t.reloptions.get("autovacuum_enabled", "").lower() in ("false", "off", "0", "no"):
                out.append(f"warning: autovacuum is disabled on {t.table} (autovacuum_enabled=false): only a manual "
                           "VACUUM cleans it")
            if t.missing and not t.partitioned:
                defaults = ", ".join(f"{k} (server default {v})" for k, v in sorted(t.missing.items()))
                out.append(f"warning: {t.table} lacks the library's autovacuum settings: {defaults}; run "
                           "'outbox db upgrade' or see docs/operations.md, 'Vacuum and bloat'")
        return out


def _parse(reloptions: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in reloptions or ():
        key, _, value = item.partition("=")
        if key.startswith("autovacuum_"):
            out[key] = value
    return out


def inspect(conn: sa.Connection, tables: Tables) -> VacuumReport | None:
    """The hot tables' autovacuum settings and the server's switch (None on SQLite: there is no autovacuum)."""
    if conn.dialect.name != "postgresql":
        return None
    version = server_version_num(conn)
    settings: Mapping[str, str] = {name: str(value) for name, value in conn.execute(sa.text(
        "SELECT name, setting FROM pg_settings WHERE name LIKE 'autovacuum%' OR name = 'track_counts'"))}
    wanted = options(version)
    report: list[TableVacuum] = []
    for name in hot_tables(tables):
        row = conn.execute(sa.text("SELECT relkind, reloptions FROM pg_class WHERE oid = to_regclass(:t)"),
                           {"t": _quote(name)}).first()
        if row is None:
            continue  # the schema check reports a missing table
        have = _parse(row.reloptions)
        report.append(TableVacuum(table=name, reloptions=have, partitioned=row.relkind == "p",
                                  missing={k: settings.get(k, "?") for k in wanted if k not in have}))
    on = settings.get("autovacuum") == "on" and settings.get("track_counts") == "on"
    return VacuumReport(autovacuum_on=on, tables=report)
