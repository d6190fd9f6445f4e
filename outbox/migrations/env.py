"""Alembic environment: one metadata (orders, outbox, inbox, consumers) for Postgres and SQLite."""

from __future__ import annotations

from alembic import context
from sqlalchemy import pool

import consumers.models
import orders.models  # noqa: F401  (registers tables on Base.metadata)
from outbox.db import Base, make_engine

config = context.config
target_metadata = Base.metadata
_ = consumers.models


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = config.get_main_option("sqlalchemy.url")
    assert url
    engine = make_engine(url, poolclass=pool.NullPool)
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
