"""Alembic environment of the library's own tables: its own version table, never an application table.

The table prefix comes from the Alembic config (``table_prefix``), so one set of scripts serves
every prefix; only tables of that prefix are compared or touched.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import context
from sqlalchemy import pool

from celery_outbox.db import make_engine
from celery_outbox.schema import DEFAULT_PREFIX, define_tables

config = context.config
tables = define_tables(sa.MetaData(), prefix=config.get_main_option("table_prefix") or DEFAULT_PREFIX)
target_metadata = tables.metadata
OURS = set(tables.names())


def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    table = obj if type_ == "table" else getattr(obj, "table", None)
    return (table.name if table is not None else name) in OURS


def _configure(**kwargs: Any) -> None:
    context.configure(target_metadata=target_metadata, version_table=tables.version_table,
                      include_object=include_object, render_as_batch=True, **kwargs)


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = config.get_main_option("sqlalchemy.url")
    assert url
    engine = make_engine(url, poolclass=pool.NullPool)
    with engine.connect() as conn:
        _configure(connection=conn)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    _configure(url=config.get_main_option("sqlalchemy.url"), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
