"""Task receipts: the plain tasks enqueued through the outbox that a worker started (the reconciler's
evidence, celery_outbox/inbox/receipts.py), with the index retention prunes them by.

Revision 0001 creates the tables ``define_tables()`` defines at the time it runs, so a database created
by this version already has them; this step adds them to a database created before (and is a no-op
otherwise).

Revision ID: co0002
Revises: co0001
Create Date: 2026-12-04
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from celery_outbox.schema import DEFAULT_PREFIX, Tables, define_tables

revision = "co0002"
down_revision = "co0001"
branch_labels = None
depends_on = None


def _tables() -> Tables:
    return define_tables(sa.MetaData(), prefix=context.config.get_main_option("table_prefix") or DEFAULT_PREFIX)


def upgrade() -> None:
    t = _tables()
    table = t.table(t.receipts)
    bind = op.get_bind()
    if table.name not in sa.inspect(bind).get_table_names():
        table.create(bind)  # with its index


def downgrade() -> None:
    t = _tables()
    t.table(t.receipts).drop(op.get_bind(), checkfirst=True)
