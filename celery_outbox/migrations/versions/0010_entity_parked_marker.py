"""An entity's version row says whether the entity may have parked messages (``parked``, inbox/ordering.py), so
a delivery that advances an entity with none skips reading them. Existing rows get 1 (may have some): the next
delivery of each entity reads its parked messages once, as before, and clears the marker when none is left.

Revision 0001 creates the tables ``define_tables()`` defines at the time it runs, so a database created by
this version already has the column; the step here is a no-op then.

Revision ID: co0010
Revises: co0009
Create Date: 2026-12-07
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from celery_outbox.schema import DEFAULT_PREFIX, Tables, define_tables

revision = "co0010"
down_revision = "co0009"
branch_labels = None
depends_on = None


def _tables() -> Tables:
    return define_tables(sa.MetaData(), prefix=context.config.get_main_option("table_prefix") or DEFAULT_PREFIX)


def upgrade() -> None:
    name = _tables().table(_tables().entity_versions).name
    if "parked" not in {c["name"] for c in sa.inspect(op.get_bind()).get_columns(name)}:
        op.add_column(name, sa.Column("parked", sa.Integer, nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table(_tables().table(_tables().entity_versions).name) as batch:
        batch.drop_column("parked")
