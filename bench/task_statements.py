"""Database round trips per run of the reference deployment's confirmation e-mail task (orders/tasks.py).

The companion of bench/consumer_statements.py (same counters: statements, pre-pings, commits,
rollbacks, pool checkouts) for the ``@outbox.task`` the Orders service enqueues with every order: N
orders are placed, then each one's e-mail task runs as a worker runs it (``task.apply`` with its
task id: Celery's tracer, ``before_start``, the delivery), and the same task id once more (a
duplicate). Every database statement of the run is counted, the fake provider's own transaction
included (it stands in for a remote provider; see orders/tasks.py), and the CPU of the run in this process
and in its Postgres backends (``cpu_us``, ``pg_cpu_us``: bench/consumer_statements.py). Prints the table and
writes bench/results/task_statements.json.

    .venv/bin/python bench/task_statements.py [--runs 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa
from celery import states

from bench._common import fresh_database, write_result
from bench.consumer_statements import KINDS, Counting, backend_cpu_s, print_round_trips
from celery_outbox.db import make_engine, make_session_factory
from celeryconfig import Settings
from orders import tasks as order_tasks
from orders.service import parse_order, place_order
from relay.factory import create_outbox


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    n = args.runs
    out: dict[str, Any] = {}
    with fresh_database() as url:
        settings = Settings(database_url=url, broker_url="memory://")
        engine = make_engine(url, settings=settings)
        sessions = make_session_factory(engine)
        outbox = create_outbox(settings, broker_url="memory://", session_factory=sessions)
        task = order_tasks.confirmation_email_task(outbox)
        ids: dict[int, tuple[str, str]] = {}
        for i in range(-1, n):
            order_id = f"bench-{i}"
            with sessions() as s:
                place_order(s, parse_order({"order_id": order_id, "customer_id": "c-1", "email": "a@example.com",
                                            "currency": "EUR", "lines": [{"sku": "s", "quantity": 1,
                                                                          "unit_price_cents": 100}]}), outbox=outbox)
            with sessions() as s:
                row = s.execute(sa.select(outbox.tables.outbox.message_id).where(
                    outbox.tables.outbox.type == order_tasks.NAME,
                    outbox.tables.outbox.payload.cast(sa.String).contains(order_id))).scalar_one()
            ids[i] = (order_id, str(row))
        engine.dispose()  # new connections from here on, so Counting learns their backends
        counting = Counting(engine)

        def one(i: int) -> None:
            order_id, task_id = ids[i]
            result = task.apply(args=[order_id], task_id=task_id)
            assert result.state == states.SUCCESS, (result.state, result.result)

        def run(label: str) -> None:
            if label == "first_run":
                one(-1)  # warm-up: statement caches, the pool's first connection
            counting.reset()
            cpu, pg_cpu = time.process_time(), backend_cpu_s(counting.backends)
            for i in range(n):
                one(i)
            cpu, pg_cpu = time.process_time() - cpu, backend_cpu_s(counting.backends) - pg_cpu
            out[label] = {k: round(counting.counts[k] / n, 3) for k in KINDS}
            out[label].update(cpu_us=round(cpu / n * 1e6, 1), pg_cpu_us=round(pg_cpu / n * 1e6, 1))
            out[label]["per_statement"] = {t: round(c / n, 3) for t, c in counting.texts.most_common()}

        run("first_run")
        run("duplicate")
        outbox.close()
        engine.dispose()
    print_round_trips(f"{order_tasks.NAME}: round trips per run ({n} runs each)", out)
    write_result("task_statements", {"task": order_tasks.NAME, "runs": n, "per_run": out})


if __name__ == "__main__":
    main()
