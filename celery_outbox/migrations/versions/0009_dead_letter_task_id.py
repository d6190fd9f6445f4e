"""A dead letter keeps the Celery task id of the delivery that gave up (``task_id``), so a replay runs under
that id and Flower shows the one task going from FAILURE to the replay's outcome (docs/operations.md,
"Flower"). Existing dead letters get NULL: they are replayed under a new task id, as before.

Revision 0001 creates the tables ``define_tables()`` defines at the time it runs, so a database created by
this version already has the column; the step here is a no-op then.

Revision ID: co0009
Revises: co0008
Create Date: 2026-12-06
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from celery_outbox.schema import DEFAULT_PREFIX, Tables, define_tables

revision = "co0009"
down_revision = "co0008"
branch_labels = None
depends_on = None


def _tables() -> Tables:
    return define_tables(sa.MetaData(), prefix=context.config.get_main_option("table_prefix") or DEFAULT_PREFIX)


def upgrade() -> None:
    name = _tables().table(_tables().dead_letters).name
    if "task_id" not in {c["name"] for c in sa.inspect(op.get_bind()).get_columns(name)}:
        op.add_column(name, sa.Column("task_id", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table(_tables().table(_tables().dead_letters).name) as batch:
        batch.drop_column("task_id")
