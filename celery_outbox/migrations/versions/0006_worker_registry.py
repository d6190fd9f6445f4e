"""Deploy-safe publishing: the worker registry table ``<prefix>workers`` (queues and task names each live
worker runs), the outbox row's ``held_for`` and the partial index ``ix_<prefix>held`` of rows waiting for a
worker that runs them (docs/scheduled.md, "Deploys"). Existing rows get NULL.

Revision 0001 creates the tables ``define_tables()`` defines at the time it runs, so a database created by
this version already has them; each step here is a no-op then.

Revision ID: co0006
Revises: co0005
Create Date: 2026-12-07
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from celery_outbox.schema import DEFAULT_PREFIX, HELD_SQL, Tables, define_tables

revision = "co0006"
down_revision = "co0005"
branch_labels = None
depends_on = None


def _tables() -> Tables:
    return define_tables(sa.MetaData(), prefix=context.config.get_main_option("table_prefix") or DEFAULT_PREFIX)


def upgrade() -> None:
    t = _tables()
    bind = op.get_bind()
    workers = t.table(t.workers)
    if workers.name not in sa.inspect(bind).get_table_names():
        workers.create(bind)
    messages = t.table(t.outbox).name
    if "held_for" not in {c["name"] for c in sa.inspect(bind).get_columns(messages)}:
        op.add_column(messages, sa.Column("held_for", sa.String(300), nullable=True))
    held = sa.text(HELD_SQL)
    op.create_index(f"ix_{t.prefix}held", messages, ["held_for"], postgresql_where=held, sqlite_where=held,
                    if_not_exists=True)


def downgrade() -> None:
    t = _tables()
    messages = t.table(t.outbox).name
    op.drop_index(f"ix_{t.prefix}held", table_name=messages, if_exists=True)
    with op.batch_alter_table(messages) as batch:
        batch.drop_column("held_for")
    t.table(t.workers).drop(op.get_bind(), checkfirst=True)
