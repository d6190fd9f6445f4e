"""SQLite: the tables Alembic created before this revision get the shape Django's migrations give them
(celery_outbox/schema.py, ``TextJSON``): JSON columns as TEXT with a ``json_valid`` CHECK (TEXT affinity: a
JSON document stays the text it was; a column declared JSON has NUMERIC affinity), and the tables keyed by an
identity (the outbox, the dead letters) AUTOINCREMENT, so a deleted row's key is never given again. SQLite
cannot alter a column's type: each such table is rebuilt from its declaration, its rows and indexes kept.

A table already in that shape (created by this version's co0001, or by Django's migrate) is left alone, and
Postgres has nothing to do: the two schemas were already the same there. The downgrade keeps the new shape,
which the code of the revisions before reads and writes as it did the old one.

Revision ID: co0008
Revises: co0007
Create Date: 2026-12-06
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from celery_outbox import schema_check
from celery_outbox.schema import DEFAULT_PREFIX, Tables, define_tables

revision = "co0008"
down_revision = "co0007"
branch_labels = None
depends_on = None


def _tables() -> Tables:
    return define_tables(sa.MetaData(), prefix=context.config.get_main_option("table_prefix") or DEFAULT_PREFIX)


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        return
    t = _tables()
    expected = schema_check.declared(t, bind.dialect)
    actual = schema_check.live(bind, t)
    # A row an older release stored with text that is not strict JSON (NaN, written around the library's
    # writer) is copied as it is: the relay dead-letters it as before, and only a write of that column is checked.
    bind.exec_driver_sql("PRAGMA ignore_check_constraints = ON")
    try:
        for name in t.names():
            want, have = expected.tables[name], actual.tables.get(name)
            if have is None or (have.columns == want.columns and have.checks == want.checks):
                continue
            live = {c["name"] for c in sa.inspect(bind).get_columns(name)}
            with op.batch_alter_table(name, copy_from=_as_of(t.metadata.tables[name], live), recreate="always"):
                pass
    finally:
        bind.exec_driver_sql("PRAGMA ignore_check_constraints = OFF")


def _as_of(table: sa.Table, live: set[str]) -> sa.Table:
    """The declared table without the columns a later revision adds (the live table has not got them yet:
    that revision adds them), with its checks, indexes and AUTOINCREMENT; the declared table itself when
    the live one has every column."""
    later = {c.name for c in table.columns} - live
    if not later:
        return table
    keep = [c for c in table.columns if c.name not in later]
    checks = [sa.CheckConstraint(str(ck.sqltext), name=ck.name) for ck in table.constraints
              if isinstance(ck, sa.CheckConstraint) and isinstance(ck.name, str)
              and not any(f'"{n}"' in str(ck.sqltext) for n in later)]
    copy = sa.Table(table.name, sa.MetaData(), *(c._copy() for c in keep), *checks,
                    sqlite_autoincrement=table.dialect_options["sqlite"]["autoincrement"])
    for ix in table.indexes:
        if all(c.name in live for c in ix.columns) and len(ix.columns) == len(ix.expressions):
            sa.Index(ix.name, *(copy.c[c.name] for c in ix.columns), unique=bool(ix.unique), **ix.kwargs)
    return copy


def downgrade() -> None:
    pass
