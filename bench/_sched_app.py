"""The app of bench/scheduled_latency.py and bench/scheduled_memory.py: one plain task that records when it
ran, sent through the outbox (public API only). ``celery -A bench._sched_app worker`` and
``outbox -A bench._sched_app relay`` load it; ``SCHEDBENCH_DATABASE_URL``, ``SCHEDBENCH_BROKER_URL`` and
``SCHEDBENCH_QUEUE`` name what it uses.
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from celery import Celery
from kombu import Exchange, Queue

from celery_outbox import Outbox, Settings
from celery_outbox.clock import SystemClock

RUNS = sa.Table("schedbench_runs", sa.MetaData(), sa.Column("task_id", sa.String(64), primary_key=True),
                sa.Column("kind", sa.String(16)), sa.Column("due_ms", sa.BigInteger),
                sa.Column("ran_at_ms", sa.BigInteger))


def build(database_url: str, broker_url: str, queue: str) -> tuple[Outbox, Any]:
    engine = sa.create_engine(database_url)
    app = Celery("schedbench", broker=broker_url, set_as_current=False)
    app.conf.update(task_routes={"schedbench.*": {"queue": queue}}, broker_connection_retry_on_startup=True,
                    task_queues=[Queue(queue, Exchange(queue), routing_key=queue, durable=True)],
                    accept_content=["json"], task_serializer="json", worker_hijack_root_logger=False)
    outbox = Outbox(app, engine=engine, settings=Settings(database_url=database_url, broker_url=broker_url,
                                                          namespace=queue.replace(".", "-")))
    outbox.define_tables(sa.MetaData())

    @app.task(name="schedbench.mark", bind=True, shared=False)  # type: ignore[untyped-decorator]
    def mark(self: Any, kind: str, due_ms: int) -> None:
        ran = SystemClock().now_ms()
        with engine.begin() as c:
            c.execute(sa.insert(RUNS).values(task_id=str(self.request.id), kind=kind, due_ms=due_ms, ran_at_ms=ran))

    return outbox, mark


outbox, mark = build(os.environ.get("SCHEDBENCH_DATABASE_URL", "sqlite://"),
                     os.environ.get("SCHEDBENCH_BROKER_URL", "memory://"), os.environ.get("SCHEDBENCH_QUEUE", "schedbench"))
app = outbox.app
