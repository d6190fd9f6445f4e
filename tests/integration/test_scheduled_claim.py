"""The relay's claim never reads rows held for later (docs/scheduled.md): a range read of ``ix_outbox_due``."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.relay.queries import due_pending

pytestmark = pytest.mark.postgres


def test_the_claim_reads_no_held_row_with_20k_held_before_the_due_ones(pg_sessions: sessionmaker[Session],
                                                                      tables: Tables) -> None:
    # Given 20k rows held for a day, written (lower seq) before 50 due rows
    with pg_sessions() as s:
        s.execute(sa.text(
            "INSERT INTO outbox_messages (message_id, type, payload, headers, created_at_ms, attempts,"
            " next_attempt_at_ms) SELECT gen_random_uuid(), 'OrderPlaced', '{}'::jsonb, '{}'::jsonb,"
            " 1000, 0, 86400000 FROM generate_series(1, 20000) g"))
        s.execute(sa.text(
            "INSERT INTO outbox_messages (message_id, type, payload, headers, created_at_ms, attempts,"
            " next_attempt_at_ms) SELECT gen_random_uuid(), 'OrderPlaced', '{}'::jsonb, '{}'::jsonb,"
            " 1000 + g, 0, 1000 + g FROM generate_series(1, 50) g"))
        s.commit()
        s.execute(sa.text("ANALYZE outbox_messages"))
        # When the relay's own statement is explained at a "now" before the held rows are due
        stmt = due_pending(now_ms=10_000, limit=100, tables=tables, skip_locked=True)
        sql = str(stmt.compile(dialect=s.get_bind().dialect, compile_kwargs={"literal_binds": True}))
        plan = "\n".join(s.execute(sa.text("EXPLAIN (ANALYZE, BUFFERS) " + sql)).scalars())
        rows = s.execute(stmt).all()
    # Then it reads the due-time index up to now: no held row is read and filtered out, no table scan
    assert "ix_outbox_due" in plan, plan
    assert "Rows Removed by Filter" not in plan and "Seq Scan" not in plan, plan
    assert [r.created_at_ms for r in rows] == list(range(1001, 1051))
