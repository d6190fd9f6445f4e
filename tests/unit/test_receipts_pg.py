"""A task receipt on Postgres is ONE statement that also turns ``synchronous_commit`` off for its own
transaction (celery_outbox/inbox/receipts.py), and only for it."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.inbox import receipts
from celery_outbox.schema import Tables

pytestmark = [pytest.mark.postgres]


def test_a_receipt_is_one_statement_committed_without_waiting_for_the_wal(
        pg_engine: sa.Engine, pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    statements: list[str] = []
    at_commit: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(pg_engine, "before_cursor_execute", count)
    try:
        task_id = uuid.uuid4()
        with pg_sessions() as session:
            @event.listens_for(session, "before_commit")
            def _seen(s: Session) -> None:
                at_commit.append(s.connection().exec_driver_sql("SHOW synchronous_commit").scalar_one())

            # When a receipt is recorded, and then again
            statements.clear()
            assert receipts.record(session, task_id, now_ms=5, tables=tables) is True
            first = list(statements)
            assert receipts.record(session, task_id, now_ms=6, tables=tables) is False
            # Then each was one statement (plus the check above), its transaction committing with
            # synchronous_commit off
            assert len(first) == 2 and first[0].lstrip().upper().startswith("INSERT"), first
            assert at_commit == ["off", "off"]
            # And the next transaction on the same connection is back to the server's setting
            assert session.connection().exec_driver_sql("SHOW synchronous_commit").scalar_one() == "on"
            rows = session.execute(sa.select(tables.receipts.task_id, tables.receipts.received_at_ms)).all()
            assert [tuple(r) for r in rows] == [(task_id, 5)]
    finally:
        event.remove(pg_engine, "before_cursor_execute", count)
