"""Run the library's Alembic migrations from code (``outbox db upgrade``, tests) and check the live schema."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

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


def downgrade(url: str, revision: str = "base", *, prefix: str = DEFAULT_PREFIX) -> None:
    command.downgrade(alembic_config(url, prefix=prefix), revision)


def head() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


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


def check(url: str, *, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """What differs between the live database and the library's tables of ``prefix`` (empty: all good)."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    tables = define_tables(sa.MetaData(), prefix=prefix)
    ours = set(tables.names())
    problems: list[str] = []
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            revision = MigrationContext.configure(conn, opts={"version_table": tables.version_table}) \
                .get_current_revision()
            if revision != head():
                problems.append(f"schema revision is {revision or 'empty'}, expected {head()}: run 'outbox db upgrade'")
            ctx = MigrationContext.configure(conn, opts={
                "include_object": lambda obj, name, type_, reflected, other: (
                    (obj.name if type_ == "table" else getattr(getattr(obj, "table", None), "name", name)) in ours),
            })
            for diff in compare_metadata(ctx, tables.metadata):
                problems.append(f"schema differs: {diff}")
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
