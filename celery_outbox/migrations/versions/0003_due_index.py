"""The relay's due-time index: pending outbox rows by (next_attempt_at_ms, seq).

A task held in the outbox until its eta (docs/scheduled.md) is a pending row due later; the claim
reads this index up to "now" and never touches a row that is not due, however many are held.
Revision co0001 creates the tables from the current ``define_tables`` (which holds this index), so
a fresh database already has it: create and drop only if needed.

Revision ID: co0003
Revises: co0002
Create Date: 2026-12-04
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from celery_outbox.schema import DEFAULT_PREFIX, PENDING_SQL

revision = "co0003"
down_revision = "co0002"
branch_labels = None
depends_on = None


def _prefix() -> str:
    return context.config.get_main_option("table_prefix") or DEFAULT_PREFIX


def upgrade() -> None:
    prefix = _prefix()
    pending = sa.text(PENDING_SQL)
    op.create_index(f"ix_{prefix}due", f"{prefix}messages", ["next_attempt_at_ms", "seq"],
                    postgresql_where=pending, sqlite_where=pending, if_not_exists=True)


def downgrade() -> None:
    prefix = _prefix()
    op.drop_index(f"ix_{prefix}due", table_name=f"{prefix}messages", if_exists=True)
