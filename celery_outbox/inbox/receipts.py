"""Task receipts: the record that a plain task enqueued through the outbox reached a worker.

An ``@outbox.task`` leaves an inbox row when it runs, so the reconciler can tell a task that ran from
one whose message the broker lost (relay/reconcile.py). A plain ``@app.task`` captured by ``.delay()``
inside ``outbox.transaction`` leaves nothing of the kind, so the worker writes a receipt instead: the
task id, in ``<prefix>task_receipts``, when it receives the task's message, at the latest before it
acks or rejects it (until then the message is the broker's unacked message, which a dead worker gives
back; celery_outbox/celery/receipts.py says why that is enough).
The message carries ``RECEIPT_HEADER`` (set at capture, celery_outbox/celery/enqueue.py), so only
tasks that came through the outbox cost a write; the worker side is celery_outbox/celery/receipts.py.

The worker's main process writes them in batches (``record_many``): one statement per batch,
``INSERT .. SELECT unnest(..) ON CONFLICT DO NOTHING``. On Postgres it runs in autocommit (no BEGIN
or COMMIT round trip: the statement is its own transaction) and does not wait for the WAL flush
(``synchronous_commit = off`` for that transaction only, set by the insert itself through
``set_config(..., is_local => true)``): a receipt lost in a database crash only makes the reconciler
send the task once more, which is the caveat plain tasks carry anyway (docs/guarantees.md).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.db import is_disconnect, is_postgres
from celery_outbox.schema import Tables
from celery_outbox.sql import insert_if_absent, statement

RECEIPT_HEADER = "outbox_receipt"
"""Task header of a plain task captured into the outbox: its worker records a receipt (value 1)."""


def wants_receipt(task_headers: Mapping[str, Any] | None) -> bool:
    """True when a task message (its Celery headers) asks its worker for a receipt."""
    return isinstance(task_headers, Mapping) and task_headers.get(RECEIPT_HEADER) == 1


def task_uuid(task_id: object) -> uuid.UUID | None:
    """The receipt key of a task id: tasks through the outbox have UUID ids; anything else has none."""
    if isinstance(task_id, uuid.UUID):
        return task_id
    if not isinstance(task_id, str) or len(task_id) > 64:
        return None
    try:
        return uuid.UUID(task_id)
    except ValueError:
        return None


def record_many(session: Session, rows: Mapping[uuid.UUID, int], *, tables: Tables) -> int:
    """Record that each task id in ``rows`` (task id -> received at, ms) reached a worker, and commit;
    the number of rows this call wrote (ids already recorded are left as they are).

    On Postgres: one statement in autocommit, without waiting for the WAL flush (module docstring).
    """
    if not rows:
        return 0
    if is_postgres(session):
        session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})  # first: the session's connection
        connection, stmt = statement(session, ("receipts", tables.receipts), lambda: _pg_receipts(tables))
        written = connection.execute(stmt, {"task_ids": list(rows), "received_at_ms": list(rows.values())}).rowcount
        session.commit()
        return int(written)
    table = tables.table(tables.receipts)
    written = sum(insert_if_absent(session, table, ("task_id",), {"task_id": k, "received_at_ms": at})
                  for k, at in rows.items())
    session.commit()
    return written


def _pg_receipts(tables: Tables) -> Any:
    """The batch insert (two parallel arrays) that also turns ``synchronous_commit`` off for its
    transaction (module docstring)."""
    table = tables.table(tables.receipts)
    id_array, at_array = postgresql.ARRAY(postgresql.UUID(as_uuid=True)), postgresql.ARRAY(sa.BigInteger())
    ids = sa.func.unnest(sa.bindparam("task_ids", type_=id_array))  # rendered with its ::UUID[] cast
    ats = sa.func.unnest(sa.bindparam("received_at_ms", type_=at_array))
    row = sa.select(ids, ats).where(sa.func.set_config("synchronous_commit", "off", sa.true()).is_not(None))
    return (postgresql.insert(table).from_select(["task_id", "received_at_ms"], row)
            .on_conflict_do_nothing(index_elements=["task_id"]).execution_options(preserve_rowcount=True))


class BatchWriter:
    """Writes batches of receipts for one process (the worker's main process, which writes them all).

    On Postgres through a libpq driver it holds ONE pooled connection in autocommit for as long as
    it lives and sends the batch insert, compiled once, with ``exec_driver_sql``: one round trip and
    little CPU per batch in a process that is serial for the whole worker (``record_many`` through
    a session costs a checkout, the session and the statement's compilation cache lookup and type
    processing per batch: about four times the CPU). Anything else goes through ``record_many`` in a
    session. A batch that fails on the held connection closes it and is tried once more on a new one
    (a server restart since the last batch); so is one that lost a new connection (a pooled
    connection that died unpinged: SQLAlchemy has invalidated the pool by then). The pool processes
    of a prefork worker never write receipts; a connection is used only by the process that opened it.
    """

    _DRIVERS = ("psycopg2", "psycopg")

    def __init__(self, *, tables: Tables) -> None:
        self._tables = tables
        self._conn: sa.Connection | None = None
        self._pid: int | None = None
        self._sql: tuple[sa.Engine, str, dict[str, Any]] | None = None

    def write(self, factory: sessionmaker[Session], rows: Mapping[uuid.UUID, int]) -> int:
        """Record ``rows`` (task id -> received at, ms) in ``factory``'s database; the number of rows written."""
        if not rows:
            return 0
        bind = factory.kw.get("bind")
        if not (isinstance(bind, sa.Engine) and bind.dialect.name == "postgresql"
                and bind.dialect.driver in self._DRIVERS):
            with factory() as session:
                return record_many(session, rows, tables=self._tables)
        reused = self._conn is not None and self._pid == os.getpid()
        try:
            return self._execute(bind, rows)
        except Exception as e:
            self.close()
            if not (reused or is_disconnect(e)):
                raise
            return self._execute(bind, rows)

    def _execute(self, engine: sa.Engine, rows: Mapping[uuid.UUID, int]) -> int:
        if self._sql is None or self._sql[0] is not engine:
            compiled = _pg_receipts(self._tables).compile(dialect=engine.dialect)
            self._sql = (engine, str(compiled), dict(compiled.params))
        conn = self._conn
        if conn is None or self._pid != os.getpid() or conn.engine is not engine:
            conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            self._conn, self._pid = conn, os.getpid()
        _, sql, params = self._sql
        written = conn.exec_driver_sql(sql, {**params, "task_ids": [str(k) for k in rows],
                                             "received_at_ms": list(rows.values())}).rowcount
        conn.commit()  # autocommit: nothing sent; ends SQLAlchemy's own transaction of the connection
        return int(written)

    def close(self) -> None:
        """Give this process's connection back to the pool (the next batch takes one again)."""
        conn, self._conn = self._conn, None
        if conn is not None and self._pid == os.getpid():
            with contextlib.suppress(Exception):
                conn.close()
        self._pid = None
