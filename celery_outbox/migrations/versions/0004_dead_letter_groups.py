"""Dead-letter groups: a ``fingerprint`` per consumer dead letter (inbox/fingerprints.py), filled in for
the dead letters already there, with the index 'outbox dead-letters groups' and a group's replay read;
an index on a dead letter's message id ('outbox trace'); and a partial index holding only the outbox
rows the relay dead-lettered (stats and groups without a scan of the published history).

Revision ID: co0004
Revises: co0003
Create Date: 2026-12-05
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from celery_outbox.inbox.fingerprints import fingerprint
from celery_outbox.schema import DEFAULT_PREFIX, Tables, define_tables

revision = "co0004"
down_revision = "co0003"
branch_labels = None
depends_on = None

BACKFILL_BATCH = 1000
NEW_INDEXES = ("dead_letters_group", "dead_letters_message", "dead")


def _tables() -> Tables:
    return define_tables(sa.MetaData(), prefix=context.config.get_main_option("table_prefix") or DEFAULT_PREFIX)


def _indexes(t: Tables) -> list[sa.Index]:
    wanted = {f"ix_{t.prefix}{n}" for n in NEW_INDEXES}
    return [ix for cls in (t.dead_letters, t.outbox) for ix in t.table(cls).indexes if ix.name in wanted]


def upgrade() -> None:
    t = _tables()
    bind = op.get_bind()
    dl = t.table(t.dead_letters)
    if "fingerprint" not in {c["name"] for c in sa.inspect(bind).get_columns(dl.name)}:
        op.add_column(dl.name, sa.Column("fingerprint", sa.String(32), nullable=True))
    last = 0
    while True:  # keyset batches: a large store is filled in without one long transaction's worth of memory
        rows = bind.execute(sa.select(dl.c.id, dl.c.consumer, dl.c.last_error)
                            .where(dl.c.id > last, dl.c.fingerprint.is_(None)).order_by(dl.c.id)
                            .limit(BACKFILL_BATCH)).all()
        if not rows:
            break
        bind.execute(dl.update().where(dl.c.id == sa.bindparam("b_id")).values(fingerprint=sa.bindparam("b_fp")),
                     [{"b_id": r.id, "b_fp": fingerprint(source="consumer", consumer=r.consumer, error=r.last_error)}
                      for r in rows])
        last = rows[-1].id
    have = {ix["name"] for cls in (t.dead_letters, t.outbox) for ix in sa.inspect(bind).get_indexes(t.table(cls).name)}
    for ix in _indexes(t):
        if ix.name not in have:
            ix.create(bind)


def downgrade() -> None:
    t = _tables()
    bind = op.get_bind()
    for ix in _indexes(t):
        ix.drop(bind, checkfirst=True)
    with op.batch_alter_table(t.table(t.dead_letters).name) as batch:
        batch.drop_column("fingerprint")
