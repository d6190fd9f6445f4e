"""Task receipts: the record that a plain task enqueued through the outbox reached a worker.

An ``@outbox.task`` leaves an inbox row when it runs, so the reconciler can tell a task that ran from
one whose message the broker lost (relay/reconcile.py). A plain ``@app.task`` captured by ``.delay()``
inside ``outbox.transaction`` leaves nothing of the kind, so the worker writes a receipt instead: the
task id, in ``<prefix>task_receipts``, when it starts the task (or, for a task with an ``eta``, when it
receives it: from then the message is the broker's unacked message, which a dead worker gives back).
The message carries ``RECEIPT_HEADER`` (set at capture, celery_outbox/celery/enqueue.py), so only
tasks that came through the outbox cost a write; the worker side is celery_outbox/celery/receipts.py.

One statement, ``INSERT .. ON CONFLICT DO NOTHING``; on Postgres the commit does not wait for the
WAL flush (``synchronous_commit = off`` for this transaction only, set by the insert itself through
``set_config(..., is_local => true)``: no ``SET LOCAL`` round trip of its own): a receipt lost in a
database crash only makes the reconciler send the task once more, which is the caveat plain tasks
carry anyway (docs/guarantees.md).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from celery_outbox.db import is_postgres
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


def record(session: Session, task_id: uuid.UUID, *, now_ms: int, tables: Tables) -> bool:
    """Record that ``task_id`` reached a worker, and commit; True when this call wrote the row."""
    values = {"task_id": task_id, "received_at_ms": now_ms}
    if is_postgres(session):
        connection, stmt = statement(session, ("receipt", tables.receipts), lambda: _pg_receipt(tables))
        inserted = connection.execute(stmt, values).rowcount == 1
    else:
        inserted = insert_if_absent(session, tables.table(tables.receipts), ("task_id",), values)
    session.commit()
    return inserted


def _pg_receipt(tables: Tables) -> Any:
    """The receipt's insert that also turns ``synchronous_commit`` off for its transaction (module docstring)."""
    table = tables.table(tables.receipts)
    row = sa.select(sa.bindparam("task_id", type_=table.c.task_id.type),
                    sa.bindparam("received_at_ms", type_=table.c.received_at_ms.type)).where(
        sa.func.set_config("synchronous_commit", "off", sa.true()).is_not(None))
    return (postgresql.insert(table).from_select(["task_id", "received_at_ms"], row)
            .on_conflict_do_nothing(index_elements=["task_id"]).execution_options(preserve_rowcount=True))
