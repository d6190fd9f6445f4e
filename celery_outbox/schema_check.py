"""The library's tables as a live database has them, against what ``schema.py`` declares (``outbox db check``).

Both sides are brought to one plain shape (``SchemaShape``): per table its columns (the dialect's type name,
nullability, server default, identity), primary key, unique constraints, CHECK constraints, indexes with their
partial predicates, the triggers (on SQLite: the parked marker's only), and on Postgres the autovacuum storage
parameters. ``declared()`` builds
it from the ``Tables`` (compiled for the database's dialect), ``live()`` reads it from the catalog, and
``differences()`` says each difference in one line. tests/django/test_django_schema.py runs it on a
database Alembic migrated and one Django migrated: the two are the same schema (docs/django.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import sqlalchemy as sa

from celery_outbox import autovacuum
from celery_outbox.schema import Tables, notify_trigger, parked_trigger

Name = tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ColumnShape:
    type: str  # as the dialect spells it, upper case: "VARCHAR(200)", "JSONB", "BIGINT"
    nullable: bool
    default: str | None = None  # the server default, unquoted ("0")
    generated: str | None = None  # "identity" (Postgres), "autoincrement" (SQLite), else None

    def describe(self) -> str:
        extra = [f"default {self.default}"] if self.default is not None else []
        extra += [self.generated] if self.generated else []
        return " ".join([self.type, "NULL" if self.nullable else "NOT NULL", *extra])


@dataclass(frozen=True, kw_only=True)
class IndexShape:
    columns: Name
    unique: bool
    where: str | None = None  # normalized predicate (see ``predicate``)

    def describe(self) -> str:
        cols = ", ".join(self.columns)
        return f"{'unique ' if self.unique else ''}({cols})" + (f" where {self.where}" if self.where else "")


@dataclass(frozen=True, kw_only=True)
class TableShape:
    columns: dict[str, ColumnShape]
    primary_key: Name
    unique: frozenset[Name] = frozenset()
    checks: frozenset[str] = frozenset()  # normalized CHECK expressions
    indexes: dict[str, IndexShape] = field(default_factory=dict)
    reloptions: dict[str, str] = field(default_factory=dict)  # the autovacuum ones (Postgres)


@dataclass(frozen=True, kw_only=True)
class SchemaShape:
    tables: dict[str, TableShape]
    # name -> normalized definition and function body; declared None: present, its text not compared
    triggers: dict[str, str | None] = field(default_factory=dict)


def predicate(sql: str | None) -> str | None:
    """A partial index's WHERE clause in one spelling, whoever wrote it: Postgres' deparsed
    ``((a IS NULL) AND (b IS NULL))``, Django's ``("a" IS NULL AND "b" IS NULL)``, schema.py's
    ``a IS NULL AND b IS NULL``. Parentheses are dropped: the library's predicates are conjunctions only."""
    if sql is None:
        return None
    return _words(sql)


def _words(sql: str) -> str:
    return " ".join(re.sub(r'[()"`]', " ", sql).lower().split())


def _default(value: Any) -> str | None:
    if value is None:
        return None
    text = str(getattr(value, "arg", value))
    text = re.sub(r"::[a-z ]+$", "", getattr(text, "text", text).strip())  # Postgres' '0'::integer
    while len(text) >= 2 and text[0] == text[-1] and text[0] in "'(":
        text = text[1:-1]
    while text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    return text


def _type(type_: sa.types.TypeEngine[Any], dialect: sa.Dialect) -> str:
    return str(type_.compile(dialect=dialect)).upper()


# --- declared -------------------------------------------------------------------------------------------


def declared(tables: Tables, dialect: sa.Dialect, *, server_version_num: int = 0,
             partitioned: bool = False) -> SchemaShape:
    """What ``schema.py`` declares for ``dialect``. ``server_version_num``: the Postgres server's, for the
    autovacuum options it knows; ``partitioned``: the outbox in the partitioned layout (docs/partitioning.md),
    whose parent holds neither unique index on message_id or dedup_key (each partition does), nor storage
    parameters, and has the reused-id trigger."""
    postgres = dialect.name == "postgresql"
    hot = set(autovacuum.hot_tables(tables)) if postgres else set()
    out: dict[str, TableShape] = {}
    for name in tables.names():
        table = tables.metadata.tables[name]
        out[name] = TableShape(
            columns={c.name: _declared_column(table, c, dialect) for c in table.columns},
            primary_key=tuple(c.name for c in table.primary_key.columns),
            unique=frozenset(tuple(c.name for c in u.columns) for u in table.constraints
                             if isinstance(u, sa.UniqueConstraint)) | frozenset(
                (c.name,) for c in table.columns if c.unique),
            checks=frozenset(_words(str(ck.sqltext)) for ck in table.constraints
                             if isinstance(ck, sa.CheckConstraint) and _applies(ck, dialect)),
            indexes={str(ix.name): IndexShape(
                columns=tuple(str(getattr(c, "name", c)) for c in ix.expressions), unique=bool(ix.unique),
                where=predicate(_where(ix, dialect))) for ix in table.indexes if _applies(ix, dialect)},
            reloptions=autovacuum.options(server_version_num) if name in hot else {},
        )
    triggers: dict[str, str | None] = {}
    marker = parked_trigger(tables)
    if postgres:
        trigger = notify_trigger(tables)
        triggers[trigger.name] = _trigger_text(trigger.definition, trigger.body)
        triggers[marker.name] = _trigger_text(marker.definition, marker.body)
    elif dialect.name == "sqlite":
        triggers[marker.name] = _sqlite_trigger_text(marker.sqlite)
    shape = SchemaShape(tables=out, triggers=triggers)
    return _partitioned(shape, tables) if partitioned else shape


def _applies(item: sa.Index | sa.Constraint, dialect: sa.Dialect) -> bool:
    ddl_if = getattr(item, "_ddl_if", None)
    return ddl_if is None or ddl_if.dialect is None or dialect.name in (
        (ddl_if.dialect,) if isinstance(ddl_if.dialect, str) else tuple(ddl_if.dialect))


def _where(index: sa.Index, dialect: sa.Dialect) -> str | None:
    where = index.dialect_options[dialect.name].get("where") if dialect.name in ("postgresql", "sqlite") else None
    return None if where is None else str(where)


def _declared_column(table: sa.Table, column: sa.Column[Any], dialect: sa.Dialect) -> ColumnShape:
    generated = None
    if column.primary_key and column.identity is not None:
        if dialect.name == "postgresql":
            generated = "identity always" if column.identity.always else "identity"
        elif table.dialect_kwargs.get("sqlite_autoincrement"):
            generated = "autoincrement"
    default = None if column.identity is not None else _default(column.server_default)
    return ColumnShape(type=_type(column.type, dialect), nullable=bool(column.nullable), default=default,
                       generated=generated)


def _partitioned(shape: SchemaShape, tables: Tables) -> SchemaShape:
    name = tables.table(tables.outbox).name
    outbox = shape.tables[name]
    dedup = f"ux_{tables.prefix}dedup"
    parent = replace(outbox, unique=outbox.unique - {("message_id",)}, reloptions={},
                     indexes={k: v for k, v in outbox.indexes.items() if k != dedup})
    # the partition commands' reused-id check (celery_outbox/ops/partitions.py): theirs to define
    return SchemaShape(tables={**shape.tables, name: parent},
                       triggers={**shape.triggers, f"{tables.prefix}message_id_unique": None})


def _trigger_text(definition: str, body: str) -> str:
    """A trigger in one spelling: its CREATE TRIGGER without schema names, then its function's body."""
    definition = re.sub(r"\bON \S+\.", "ON ", definition)
    definition = re.sub(r"\bEXECUTE PROCEDURE\b", "EXECUTE FUNCTION", definition)
    return f"{' '.join(definition.split())} / {' '.join(body.split())}"


def _sqlite_trigger_text(sql: str) -> str:
    """A SQLite trigger's CREATE TRIGGER in one spelling (its whitespace)."""
    return " ".join(sql.split())


# --- live -----------------------------------------------------------------------------------------------


def live(conn: sa.Connection, tables: Tables) -> SchemaShape:
    """The library's tables as ``conn``'s database has them (absent tables are left out)."""
    insp = sa.inspect(conn)
    present = set(insp.get_table_names())
    out: dict[str, TableShape] = {}
    postgres = conn.dialect.name == "postgresql"
    for name in tables.names():
        if name not in present:
            continue
        auto = postgres or _sqlite_autoincrement(conn, name)
        columns = {}
        for c in insp.get_columns(name):
            generated = None
            if postgres and c.get("identity"):
                generated = "identity always" if c["identity"].get("always") else "identity"
            elif not postgres and auto and c.get("primary_key"):
                generated = "autoincrement"
            columns[c["name"]] = ColumnShape(type=_type(c["type"], conn.dialect), nullable=bool(c["nullable"]),
                                             default=None if generated else _default(c.get("default")),
                                             generated=generated)
        out[name] = TableShape(
            columns=columns,
            primary_key=tuple(insp.get_pk_constraint(name)["constrained_columns"]),
            unique=_pg_unique(insp, name) if postgres else _sqlite_unique(conn, name),
            checks=frozenset(_words(ck["sqltext"]) for ck in insp.get_check_constraints(name)),
            indexes=_pg_indexes(conn, name) if postgres else _sqlite_indexes(conn, name),
            reloptions=_reloptions(conn, name) if postgres else {},
        )
    triggers: dict[str, str | None] = {**(_pg_triggers(conn, tables) if postgres else _sqlite_triggers(conn, tables))}
    return SchemaShape(tables=out, triggers=triggers)


def _sqlite_triggers(conn: sa.Connection, tables: Tables) -> dict[str, str]:
    rows = conn.execute(sa.text("SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name IN :t")
                        .bindparams(sa.bindparam("t", expanding=True)), {"t": list(tables.names())})
    return {r.name: _sqlite_trigger_text(r.sql) for r in rows}


def _sqlite_autoincrement(conn: sa.Connection, table: str) -> bool:
    sql = conn.execute(sa.text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = :t"),
                       {"t": table}).scalar()
    return bool(sql and re.search(r"\bAUTOINCREMENT\b", sql, re.IGNORECASE))


def _pg_unique(insp: sa.Inspector, table: str) -> frozenset[Name]:
    return frozenset(tuple(u["column_names"]) for u in insp.get_unique_constraints(table))


def _sqlite_unique(conn: sa.Connection, table: str) -> frozenset[Name]:
    """UNIQUE constraints, written inline on the column (Django) or apart (SQLAlchemy): their automatic indexes."""
    return frozenset(_sqlite_index_columns(conn, str(row["name"]))
                     for row in conn.exec_driver_sql(f"PRAGMA index_list({_quote(table)})").mappings()
                     if row["origin"] == "u")


def _sqlite_index_columns(conn: sa.Connection, index: str) -> Name:
    return tuple(str(r["name"]) for r in conn.exec_driver_sql(f"PRAGMA index_info({_quote(index)})").mappings())


def _pg_indexes(conn: sa.Connection, table: str) -> dict[str, IndexShape]:
    """Indexes that no constraint owns (a primary key or a UNIQUE constraint is compared as such)."""
    rows = conn.execute(sa.text(
        "SELECT ic.relname AS name, i.indisunique AS is_unique, pg_get_expr(i.indpred, i.indrelid) AS predicate, "
        "array(SELECT a.attname::text FROM unnest(i.indkey) WITH ORDINALITY k(attnum, n) "
        "      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum ORDER BY k.n) AS cols "
        "FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid "
        "WHERE i.indrelid = to_regclass(:t) "
        "AND NOT EXISTS (SELECT 1 FROM pg_constraint con WHERE con.conindid = i.indexrelid "
        "                AND con.conrelid = i.indrelid)"), {"t": _quote(table)})
    return {r.name: IndexShape(columns=tuple(r.cols), unique=bool(r.is_unique), where=predicate(r.predicate))
            for r in rows}


def _sqlite_indexes(conn: sa.Connection, table: str) -> dict[str, IndexShape]:
    """Indexes made by CREATE INDEX (origin 'c'); a UNIQUE constraint's automatic index is compared as such."""
    out: dict[str, IndexShape] = {}
    for row in conn.exec_driver_sql(f"PRAGMA index_list({_quote(table)})").mappings():
        if row["origin"] != "c":
            continue
        name = str(row["name"])
        cols = _sqlite_index_columns(conn, name)
        sql = conn.execute(sa.text("SELECT sql FROM sqlite_master WHERE type = 'index' AND name = :n"),
                           {"n": name}).scalar() or ""
        match = re.search(r"\bWHERE\b(.*)$", sql, re.IGNORECASE | re.DOTALL)
        out[name] = IndexShape(columns=cols, unique=bool(row["unique"]),
                               where=predicate(match.group(1)) if match else None)
    return out


def _reloptions(conn: sa.Connection, table: str) -> dict[str, str]:
    options = conn.execute(sa.text("SELECT reloptions FROM pg_class WHERE oid = to_regclass(:t)"),
                           {"t": _quote(table)}).scalar()
    out: dict[str, str] = {}
    for item in options or ():
        key, _, value = str(item).partition("=")
        if key.startswith("autovacuum_"):
            out[key] = value
    return out


def _pg_triggers(conn: sa.Connection, tables: Tables) -> dict[str, str]:
    rows = conn.execute(sa.text(
        "SELECT t.tgname AS name, pg_get_triggerdef(t.oid) AS definition, p.prosrc AS body "
        "FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid "
        "WHERE NOT t.tgisinternal AND t.tgrelid = ANY(:oids)"),
        {"oids": [oid for oid in (conn.execute(sa.text("SELECT to_regclass(:t)::oid"), {"t": _quote(n)}).scalar()
                                  for n in tables.names()) if oid is not None]})
    return {r.name: _trigger_text(r.definition, r.body) for r in rows}


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# --- compare --------------------------------------------------------------------------------------------


def differences(expected: SchemaShape, actual: SchemaShape, *, reloptions: bool = True) -> list[str]:
    """Each way ``actual`` differs from ``expected``, one line each (empty: the same schema).
    ``reloptions=False`` leaves the autovacuum settings out (``outbox db check`` shows them as warnings)."""
    out: list[str] = []
    for name, want in expected.tables.items():
        have = actual.tables.get(name)
        if have is None:
            out.append(f"table {name}: missing")
            continue
        out += _table_differences(name, want, have, reloptions=reloptions)
    for name in sorted(actual.tables.keys() - expected.tables.keys()):
        out.append(f"table {name}: not declared")
    for name, want_t in sorted(expected.triggers.items()):
        have_t = actual.triggers.get(name)
        if have_t is None:
            out.append(f"trigger {name}: missing")
        elif want_t is not None and have_t != want_t:
            out.append(f"trigger {name}: is {have_t!r}, declared {want_t!r}")
    for name in sorted(actual.triggers.keys() - expected.triggers.keys()):
        out.append(f"trigger {name}: not declared ({actual.triggers[name]})")
    return out


_Shape = TypeVar("_Shape", ColumnShape, IndexShape)


def _shape_differences(label: Callable[[str], str], want: Mapping[str, _Shape], have: Mapping[str, _Shape]) -> list[str]:
    """One line per named column or index that is missing, differs, or is not declared."""
    out: list[str] = []
    for key, w in want.items():
        h = have.get(key)
        if h is None:
            out.append(f"{label(key)}: missing (declared {w.describe()})")
        elif h != w:
            out.append(f"{label(key)}: is {h.describe()}, declared {w.describe()}")
    for key in sorted(have.keys() - want.keys()):
        out.append(f"{label(key)}: not declared ({have[key].describe()})")
    return out


def _table_differences(name: str, want: TableShape, have: TableShape, *, reloptions: bool) -> list[str]:
    out = _shape_differences(lambda col: f"column {name}.{col}", want.columns, have.columns)
    if have.primary_key != want.primary_key:
        out.append(f"table {name}: primary key is ({', '.join(have.primary_key)}), "
                   f"declared ({', '.join(want.primary_key)})")
    for cols in sorted(want.unique - have.unique):
        out.append(f"table {name}: unique ({', '.join(cols)}) missing")
    for cols in sorted(have.unique - want.unique):
        out.append(f"table {name}: unique ({', '.join(cols)}) not declared")
    for check in sorted(want.checks - have.checks):
        out.append(f"table {name}: check ({check}) missing")
    for check in sorted(have.checks - want.checks):
        out.append(f"table {name}: check ({check}) not declared")
    out += _shape_differences(lambda ix: f"index {ix} on {name}", want.indexes, have.indexes)
    if reloptions:
        for key in sorted(want.reloptions.keys() | have.reloptions.keys()):
            w_opt, h_opt = want.reloptions.get(key), have.reloptions.get(key)
            if w_opt != h_opt:
                out.append(f"table {name}: {key} is {h_opt or 'the server default'}, "
                           f"declared {w_opt or 'the server default'}")
    return out


def check(conn: sa.Connection, tables: Tables, *, reloptions: bool = True, partitioned: bool = False) -> list[str]:
    """The differences between ``conn``'s database and the declared schema, one line each."""
    version = autovacuum.server_version_num(conn) if conn.dialect.name == "postgresql" else 0
    expected = declared(tables, conn.dialect, server_version_num=version, partitioned=partitioned)
    return differences(expected, live(conn, tables), reloptions=reloptions)
