"""The relay's query stays on the partial index however much published history there is."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.relay.queries import due_pending

pytestmark = pytest.mark.postgres


def test_pending_query_uses_partial_index_with_100k_published_rows(pg_sessions: sessionmaker[Session],
                                                                   tables: Tables) -> None:
    # Given 100k published rows and 50 pending ones
    with pg_sessions() as s:
        s.execute(sa.text(
            "INSERT INTO outbox_messages (message_id, type, payload, headers, created_at_ms, published_at_ms,"
            " attempts, next_attempt_at_ms) SELECT gen_random_uuid(), 'OrderPlaced', '{}'::jsonb,"
            " '{}'::jsonb, g, g + 1, 0, g FROM generate_series(1, 100000) g"))
        s.execute(sa.text(
            "INSERT INTO outbox_messages (message_id, type, payload, headers, created_at_ms, attempts,"
            " next_attempt_at_ms) SELECT gen_random_uuid(), 'OrderPlaced', '{}'::jsonb, '{}'::jsonb,"
            " g, 0, g FROM generate_series(1, 50) g"))
        s.commit()
        s.execute(sa.text("ANALYZE outbox_messages"))
        # When the relay's own statement is explained
        stmt = due_pending(now_ms=10**13, limit=100, tables=tables, skip_locked=True)
        sql = str(stmt.compile(dialect=s.get_bind().dialect, compile_kwargs={"literal_binds": True}))
        plan = "\n".join(s.execute(sa.text("EXPLAIN (ANALYZE, BUFFERS) " + sql)).scalars())
        rows = s.execute(stmt).scalars().all()
    # Then the plan reads the partial index and never the whole table
    assert "ix_outbox_pending" in plan, plan
    assert "Seq Scan" not in plan, plan
    assert len(rows) == 50
