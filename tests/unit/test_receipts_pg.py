"""A batch of task receipts on Postgres is ONE statement, in autocommit (its own transaction: no BEGIN or
COMMIT round trip), that also turns ``synchronous_commit`` off for that transaction only
(celery_outbox/inbox/receipts.py)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.inbox import receipts
from celery_outbox.schema import Tables

pytestmark = [pytest.mark.postgres]


def test_a_batch_of_receipts_is_one_autocommitted_statement_that_does_not_wait_for_the_wal(
        pg_engine: sa.Engine, pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    statements: list[tuple[str, bool]] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append((statement, bool(cursor.connection.autocommit)))

    event.listen(pg_engine, "before_cursor_execute", count)
    try:
        first, second, third = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
        with pg_sessions() as session:
            # When a batch of two receipts is recorded, then a batch with one of them again and a new one
            assert receipts.record_many(session, {first: 5, second: 6}, tables=tables) == 2
            batch = list(statements)
            assert receipts.record_many(session, {second: 7, third: 8}, tables=tables) == 1
            # Then each batch was one INSERT, sent in autocommit (the driver sent no BEGIN), whose
            # transaction turns synchronous_commit off for itself
            assert len(batch) == 1 and len(statements) == 2, statements
            text, autocommit = batch[0]
            assert text.lstrip().upper().startswith("INSERT") and autocommit
            assert "set_config" in text and "unnest" in text
        with pg_sessions() as session:
            # And the next transaction on that connection is back to the server's setting
            assert session.connection().exec_driver_sql("SHOW synchronous_commit").scalar_one() == "on"
            rows = session.execute(sa.select(tables.receipts.task_id, tables.receipts.received_at_ms)).all()
            assert {tuple(r) for r in rows} == {(first, 5), (second, 6), (third, 8)}
    finally:
        event.remove(pg_engine, "before_cursor_execute", count)


def test_a_local_setting_in_an_autocommitted_statement_holds_for_that_statement_only(pg_engine: sa.Engine) -> None:
    # Given an autocommit connection (what a receipt batch runs on)
    with pg_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        # When one statement sets synchronous_commit locally, as the receipt batch does
        inside = conn.exec_driver_sql("SELECT set_config('synchronous_commit', 'off', true), "
                                      "current_setting('synchronous_commit')").one()
        # Then it is off for that statement's own transaction (its commit), and on again after it
        assert tuple(inside) == ("off", "off")
        assert conn.exec_driver_sql("SHOW synchronous_commit").scalar_one() == "on"



def _terminate(engine: sa.Engine, pid: int) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        assert c.exec_driver_sql(f"SELECT pg_terminate_backend({pid})").scalar_one() is True
        for _ in range(100):  # gone once the server no longer lists it (a wait, not a timing check)
            if not c.exec_driver_sql(f"SELECT 1 FROM pg_stat_activity WHERE pid = {pid}").first():
                return
            time.sleep(0.05)
    pytest.fail(f"backend {pid} still listed after pg_terminate_backend")


def test_the_worker_writes_its_batches_on_one_held_connection_one_autocommitted_statement_each(
        pg_engine: sa.Engine, pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    seen: list[tuple[str, bool, int]] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append((statement, bool(cursor.connection.autocommit), cursor.connection.info.backend_pid))

    writer = receipts.BatchWriter(tables=tables)
    event.listen(pg_engine, "before_cursor_execute", count)
    try:
        ids = [uuid.uuid4() for _ in range(4)]
        # When the worker writes two batches, the second repeating one receipt
        assert writer.write(pg_sessions, {ids[0]: 1, ids[1]: 2}) == 2
        assert writer.write(pg_sessions, {ids[1]: 3, ids[2]: 4, ids[3]: 5}) == 2
        # Then each was one INSERT, in autocommit, with synchronous_commit off for itself, on the same connection
        assert [(s.lstrip().split()[0].upper(), autocommit) for s, autocommit, _ in seen] == [("INSERT", True)] * 2
        assert all("set_config" in s for s, _, _ in seen) and seen[0][2] == seen[1][2]
    finally:
        event.remove(pg_engine, "before_cursor_execute", count)
        writer.close()
    with pg_sessions() as session:
        rows = session.execute(sa.select(tables.receipts.task_id, tables.receipts.received_at_ms)).all()
    assert {tuple(r) for r in rows} == {(ids[0], 1), (ids[1], 2), (ids[2], 4), (ids[3], 5)}


def test_a_batch_after_the_server_dropped_the_held_connection_is_written_on_a_new_one(
        pg_engine: sa.Engine, pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a worker that wrote a batch, and the server that since dropped its connection (a restart)
    writer = receipts.BatchWriter(tables=tables)
    pids: list[int] = []

    def pid(conn: Any, cursor: Any, *args: Any) -> None:
        pids.append(cursor.connection.info.backend_pid)

    event.listen(pg_engine, "before_cursor_execute", pid)
    try:
        assert writer.write(pg_sessions, {uuid.uuid4(): 1}) == 1
        _terminate(pg_engine, pids[0])
        # When it writes the next batch
        later = uuid.uuid4()
        # Then that batch is written, on a new connection
        assert writer.write(pg_sessions, {later: 2}) == 1
        assert pids[-1] != pids[0]
    finally:
        event.remove(pg_engine, "before_cursor_execute", pid)
        writer.close()
    with pg_sessions() as session:
        assert session.get(tables.receipts, later) is not None
