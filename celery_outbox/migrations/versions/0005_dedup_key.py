"""Deduplicate by key: the outbox row's ``dedup_key`` and the partial unique index ``ux_<prefix>dedup``
(at most one pending row per key; docs/scheduled.md, "Deduplicate by key"). Existing rows get NULL.

Revision ID: co0005
Revises: co0004
Create Date: 2026-12-06
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from celery_outbox.schema import DEDUP_SQL, DEFAULT_PREFIX

revision = "co0005"
down_revision = "co0004"
branch_labels = None
depends_on = None


def _prefix() -> str:
    return context.config.get_main_option("table_prefix") or DEFAULT_PREFIX


def upgrade() -> None:
    prefix = _prefix()
    table = f"{prefix}messages"
    bind = op.get_bind()
    # co0001 creates the tables from the current define_tables, so a fresh database already has both.
    if "dedup_key" not in {c["name"] for c in sa.inspect(bind).get_columns(table)}:
        op.add_column(table, sa.Column("dedup_key", sa.String(200), nullable=True))
    dedup = sa.text(DEDUP_SQL)
    op.create_index(f"ux_{prefix}dedup", table, ["dedup_key"], unique=True, postgresql_where=dedup,
                    sqlite_where=dedup, if_not_exists=True)


def downgrade() -> None:
    prefix = _prefix()
    table = f"{prefix}messages"
    op.drop_index(f"ux_{prefix}dedup", table_name=table, if_exists=True)
    with op.batch_alter_table(table) as batch:
        batch.drop_column("dedup_key")
