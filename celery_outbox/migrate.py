"""Run the library's Alembic migrations from code (``outbox db upgrade``, tests) and check the live schema;
``alembic_filters`` keeps the library's tables out of YOUR Alembic environment's autogenerate."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from celery_outbox import layout, schema_check
from celery_outbox.db import make_engine
from celery_outbox.schema import DEFAULT_PREFIX, define_tables

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(url: str, *, prefix: str = DEFAULT_PREFIX) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.set_main_option("table_prefix", prefix)
    return cfg


def upgrade(url: str, revision: str = "head", *, prefix: str = DEFAULT_PREFIX) -> None:
    command.upgrade(alembic_config(url, prefix=prefix), revision)


def stamp(url: str, revision: str = "head", *, prefix: str = DEFAULT_PREFIX) -> None:
    """Record ``revision`` in the library's version table without running a migration (tables created
    by other means: Django's ``migrate``, your own Alembic migration of ``define_tables``)."""
    command.stamp(alembic_config(url, prefix=prefix), revision)


def downgrade(url: str, revision: str = "base", *, prefix: str = DEFAULT_PREFIX) -> None:
    command.downgrade(alembic_config(url, prefix=prefix), revision)


def head() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def revisions() -> tuple[str, ...]:
    """The library's revision ids, oldest first."""
    from alembic.script import ScriptDirectory

    walked = ScriptDirectory.from_config(alembic_config("sqlite://")).walk_revisions()
    return tuple(reversed([r.revision for r in walked]))


def current(url: str, *, prefix: str = DEFAULT_PREFIX) -> str | None:
    from alembic.runtime.migration import MigrationContext

    tables = define_tables(sa.MetaData(), prefix=prefix)
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table": tables.version_table})
            return ctx.get_current_revision()
    finally:
        engine.dispose()


def check(url: str, *, prefix: str = DEFAULT_PREFIX, reloptions: bool = False) -> list[str]:
    """What differs between the live database and the library's tables of ``prefix``, one line each (empty: all
    good): the recorded revision, then columns, types, nullability, keys, CHECKs, indexes with their partial
    predicates, the parked marker's trigger and, on Postgres, the NOTIFY trigger (celery_outbox/schema_check.py).
    ``reloptions=True`` adds the hot tables' autovacuum settings (``outbox db check`` shows those apart, as warnings)."""
    from alembic.runtime.migration import MigrationContext

    tables = define_tables(sa.MetaData(), prefix=prefix)
    problems: list[str] = []
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            revision = MigrationContext.configure(conn, opts={"version_table": tables.version_table}) \
                .get_current_revision()
            if revision != head():
                problems.append(f"schema revision is {revision or 'empty'}, expected {head()}: run 'outbox db upgrade'")
            partitioned = layout.is_partitioned(conn, tables=tables)  # docs/partitioning.md
            problems += schema_check.check(conn, tables, reloptions=reloptions, partitioned=partitioned)
    finally:
        engine.dispose()
    return problems


def tables_present(url: str, *, prefix: str = DEFAULT_PREFIX) -> bool:
    """True when every library table of ``prefix`` exists (created by any means, versioned or not)."""
    tables = define_tables(sa.MetaData(), prefix=prefix)
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return set(tables.names()) <= set(sa.inspect(conn).get_table_names())
    finally:
        engine.dispose()


IncludeName = Callable[[str | None, str, Mapping[str, Any]], bool]
IncludeObject = Callable[[Any, str | None, str, bool, Any], bool]


def library_table_names(*, prefix: str = DEFAULT_PREFIX) -> frozenset[str]:
    """Every table the library's own migrations own under ``prefix``, its version table included."""
    tables = define_tables(sa.MetaData(), prefix=prefix)
    return frozenset((*tables.names(), tables.version_table))


def alembic_filters(*, prefix: str = DEFAULT_PREFIX, include_name: IncludeName | None = None,
                    include_object: IncludeObject | None = None) -> dict[str, Any]:
    """``context.configure(..., **alembic_filters())`` in YOUR Alembic ``env.py``: autogenerate then never
    proposes to create, change or drop the library's tables (``outbox_schema_version`` included), which
    ``outbox db upgrade`` owns, whether they are in your metadata (``outbox.define_tables``) or only in
    the database. Filters of your own are applied after ours (``include_name=``, ``include_object=``)."""
    ours = library_table_names(prefix=prefix)

    def name_filter(name: str | None, type_: str, parent_names: Mapping[str, Any]) -> bool:
        table = name if type_ == "table" else parent_names.get("table_name")
        if table in ours:
            return False
        return include_name(name, type_, parent_names) if include_name is not None else True

    def object_filter(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        table = obj if type_ == "table" else getattr(obj, "table", None)
        if (getattr(table, "name", None) if table is not None else name) in ours:
            return False
        return include_object(obj, name, type_, reflected, compare_to) if include_object is not None else True

    return {"include_name": name_filter, "include_object": object_filter}
