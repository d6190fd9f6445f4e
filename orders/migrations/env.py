"""Alembic environment of the reference deployment's own tables (orders and the consumers' effects).

The library's tables have their own environment and version table (``outbox db upgrade``); this one
keeps Alembic's default ``alembic_version``, as any application would.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import pool

import consumers.models
import orders.models
from celery_outbox import make_engine

config = context.config
target_metadata = consumers.models.Base.metadata  # the consumers' tables and, imported above, the Orders service's
_ = orders.models


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    assert url
    engine = make_engine(url, poolclass=pool.NullPool)
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


run_migrations_online()
