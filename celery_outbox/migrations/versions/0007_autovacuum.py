"""Autovacuum settings of the hot tables (Postgres only): the outbox, inbox, task receipts and entity versions are
vacuumed after a fixed number of dead tuples instead of 20 % of the table (celery_outbox/autovacuum.py, the values
and why: docs/operations.md "Vacuum and bloat"). SQLite has no autovacuum: a no-op there. The downgrade resets
them to the server's defaults.

Revision ID: co0007
Revises: co0006
Create Date: 2026-12-03
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from celery_outbox import autovacuum
from celery_outbox.schema import DEFAULT_PREFIX, Tables, define_tables

revision = "co0007"
down_revision = "co0006"
branch_labels = None
depends_on = None


def _tables() -> Tables:
    return define_tables(sa.MetaData(), prefix=context.config.get_main_option("table_prefix") or DEFAULT_PREFIX)


def upgrade() -> None:
    autovacuum.apply(op.get_bind(), _tables())


def downgrade() -> None:
    autovacuum.reset(op.get_bind(), _tables())
