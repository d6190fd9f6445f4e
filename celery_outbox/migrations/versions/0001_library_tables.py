"""The library's tables (outbox, inbox, attempts, dead letters, parked, entity versions, counters) and,
on Postgres, the NOTIFY trigger that wakes a standalone relay.

Revision ID: co0001
Revises:
Create Date: 2026-12-03
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from celery_outbox.schema import DEFAULT_PREFIX, Tables, define_tables

revision = "co0001"
down_revision = None
branch_labels = None
depends_on = None


def _tables() -> Tables:
    return define_tables(sa.MetaData(), prefix=context.config.get_main_option("table_prefix") or DEFAULT_PREFIX)


def upgrade() -> None:
    t = _tables()
    bind = op.get_bind()
    t.metadata.create_all(bind)
    if bind.dialect.name == "postgresql":
        fn, table = f"{t.prefix}notify", t.table(t.outbox).name
        op.execute(f"CREATE OR REPLACE FUNCTION {fn}() RETURNS trigger AS $$ "
                   f"BEGIN PERFORM pg_notify('{t.notify_channel}', ''); RETURN NULL; END $$ LANGUAGE plpgsql")
        op.execute(f"CREATE TRIGGER {fn} AFTER INSERT ON {table} FOR EACH STATEMENT EXECUTE FUNCTION {fn}()")


def downgrade() -> None:
    t = _tables()
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        fn, table = f"{t.prefix}notify", t.table(t.outbox).name
        op.execute(f"DROP TRIGGER IF EXISTS {fn} ON {table}")
        op.execute(f"DROP FUNCTION IF EXISTS {fn}()")
    t.metadata.drop_all(bind)
