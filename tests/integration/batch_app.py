"""A Celery app with one batch consumer, for tests/integration/test_batch_worker.py (``celery -A`` this module).

Its effect is a bulk upsert that adds 1 to ``batch_docs.effects`` per order: an order whose row reads 1
had its effect exactly once. An order with ``"poison": true`` always fails its batch.
``BATCH_TEST_STALL_MARKER``: every batch writes its effect, adds a line to that file and
stalls (uncommitted), so the worker ends up holding its whole prefetch unacked and the test can SIGKILL it
in the middle of its batches. ``BATCH_TEST_REDIS_KEYS``: on Redis, the prefix of kombu's unacked keys (below)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from celery import Celery
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from celery_outbox import Envelope, Outbox, Settings
from tests.integration.batch_effect import BATCH_SIZE, DOCS

app = Celery("batch_test", broker=os.environ.get("OUTBOX_BROKER_URL", "memory://"), set_as_current=True)
app.conf.update(accept_content=["json"], task_serializer="json", result_serializer="json",
                worker_prefetch_multiplier=BATCH_SIZE, worker_send_task_events=True)
if os.environ.get("BATCH_TEST_REDIS_KEYS"):
    # kombu's Redis transport keeps every worker's unacked messages, and the mutex its restore scan takes, under
    # fixed key names of the database ("unacked", "unacked_index", "unacked_mutex"), shared by every process on
    # that Redis: this app's own names keep another process's scan, restore or stuck mutex out of its redelivery.
    prefix = os.environ["BATCH_TEST_REDIS_KEYS"]
    app.conf.broker_transport_options = {"unacked_key": f"{prefix}.unacked", "unacked_index_key": f"{prefix}.unacked_index",
                                         "unacked_mutex_key": f"{prefix}.unacked_mutex"}
outbox = Outbox(app, settings=Settings.from_env())


@outbox.consumer("OrderPlaced", name="index", batch_size=BATCH_SIZE, batch_wait_ms=100)
def index(session: Session, events: list[Envelope]) -> None:
    marker = os.environ.get("BATCH_TEST_STALL_MARKER")
    poison = [e for e in events if e.payload.get("poison")]
    if poison:
        raise ValueError(f"cannot index {poison[0].payload['order_id']}")
    rows = [{"order_id": str(e.payload["order_id"]), "effects": 1} for e in events]
    stmt = insert(DOCS).values(rows)
    session.execute(stmt.on_conflict_do_update(index_elements=["order_id"], set_={"effects": DOCS.c.effects + 1}))
    if marker:
        session.flush()
        with Path(marker).open("a") as stalled:
            stalled.write(f"{len(events)}\n")
        time.sleep(120)  # killed here, its batch written but not committed
