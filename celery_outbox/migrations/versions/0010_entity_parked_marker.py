"""An entity's version row says whether the entity may have parked messages (``parked``, inbox/ordering.py), so
a delivery that advances an entity with none skips reading them. Existing rows get 1 (may have some): the next
delivery of each entity reads its parked messages once, as before, and clears the marker when none is left.
The trigger ``schema.parked_trigger`` declares sets the marker when a message is parked, also by a worker of the
release before, which parks without setting it (a rolling deploy).

Revision 0001 creates the tables ``define_tables()`` defines at the time it runs, so a database created by
this version already has the column; the column's step here is a no-op then (the trigger is created either way).

Revision ID: co0010
Revises: co0009
Create Date: 2026-12-07
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from celery_outbox.schema import DEFAULT_PREFIX, Tables, define_tables, parked_trigger

revision = "co0010"
down_revision = "co0009"
branch_labels = None
depends_on = None


def _tables() -> Tables:
    return define_tables(sa.MetaData(), prefix=context.config.get_main_option("table_prefix") or DEFAULT_PREFIX)


def upgrade() -> None:
    t = _tables()
    name = t.table(t.entity_versions).name
    if "parked" not in {c["name"] for c in sa.inspect(op.get_bind()).get_columns(name)}:
        op.add_column(name, sa.Column("parked", sa.Integer, nullable=False, server_default="1"))
    for statement in parked_trigger(t).create(op.get_bind().dialect.name):
        op.execute(statement)


def downgrade() -> None:
    t = _tables()
    for statement in parked_trigger(t).drop(op.get_bind().dialect.name):
        op.execute(statement)
    with op.batch_alter_table(t.table(t.entity_versions).name) as batch:
        batch.drop_column("parked")
