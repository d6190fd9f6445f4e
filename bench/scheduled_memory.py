"""Memory of a worker while scheduled tasks are pending: held as outbox rows vs held by the worker (Celery's eta).

Postgres (a fresh database), the shared Redis broker, one ``celery worker`` (solo pool) of
``bench/_sched_app.py``. The worker's resident memory (RSS, psutil) ``--settle`` seconds after it is
ready and, in the eta phase, after it has taken every message:

- ``empty``: nothing pending;
- ``outbox``: ``--held`` tasks (default 100,000) with an eta an hour ahead, held as outbox rows (one sent
  through the outbox, copied by INSERT ... SELECT with new ids; the worker never reads them);
- ``broker_eta``: ``--direct`` tasks (default 20,000) with the same eta sent straight to the broker as plain
  Celery sends them: the worker takes each and keeps it in memory, unacked, until due.

Prints the RSS of each phase and the per-task cost; writes bench/results/scheduled_memory.json.

    .venv/bin/python bench/scheduled_memory.py [--held 100000] [--direct 20000] [--settle 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil
import redis
import sqlalchemy as sa
from kombu import Connection, Exchange, Queue
from sqlalchemy.orm import sessionmaker

from bench._common import fresh_database, write_result
from celery_outbox.celery.enqueue import publishing_directly
from devtools.processes import Child, wait_until

ROOT = Path(__file__).resolve().parent.parent

REDIS_URL = os.environ.get("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def worker_rss(env: dict[str, str], queue: str, log: Path, settle_s: float, *, drained: Any = None) -> int:
    w = Child(name="worker", cwd=ROOT, env=env, log_path=log, argv=[
        sys.executable, "-m", "celery", "-A", "bench._sched_app", "worker", "-Q", queue, "-P", "solo",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"]).start()
    try:
        if not wait_until(lambda: "ready." in log.read_text(errors="replace"), timeout_s=60):
            raise SystemExit(w.log_tail())
        if drained is not None and not wait_until(drained, timeout_s=600, interval_s=1.0):
            raise SystemExit("the worker did not take every eta message\n" + w.log_tail())
        time.sleep(settle_s)
        assert w.proc is not None
        proc = psutil.Process(w.proc.pid)
        return int(sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]))
    finally:
        w.stop(timeout_s=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--held", type=int, default=100_000)
    p.add_argument("--direct", type=int, default=20_000)
    p.add_argument("--settle", type=float, default=5.0)
    a = p.parse_args()
    queue = f"schedmem.{uuid.uuid4().hex[:8]}"
    r: dict[str, Any] = {"held": a.held, "direct": a.direct, "broker": "redis", "database": "postgres",
                         "worker": "solo"}
    with tempfile.TemporaryDirectory() as tmp, fresh_database("outbox_schedmem") as url:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env.update({"SCHEDBENCH_DATABASE_URL": url, "SCHEDBENCH_BROKER_URL": REDIS_URL, "SCHEDBENCH_QUEUE": queue,
                    "PYTHONPATH": str(ROOT)})
        from bench import _sched_app
        outbox, mark = _sched_app.build(url, REDIS_URL, queue)
        engine = sa.create_engine(url)
        _sched_app.RUNS.metadata.create_all(engine)
        sessions = sessionmaker(engine)
        logs = Path(tmp)
        r["empty_rss_mb"] = round(worker_rss(env, queue, logs / "w0.log", a.settle) / 2**20, 1)
        print(f"empty: {r['empty_rss_mb']} MB")
        with sessions.begin() as s, outbox.transaction(s):
            mark.apply_async(("held", 0), countdown=3600)
        table = outbox.tables.table(outbox.tables.outbox).name
        with engine.begin() as c:
            c.exec_driver_sql(
                f"INSERT INTO {table} (message_id, type, payload, headers, created_at_ms, attempts, next_attempt_at_ms) "
                f"SELECT gen_random_uuid(), type, payload, headers, created_at_ms, 0, next_attempt_at_ms "
                f"FROM {table}, generate_series(2, %(n)s)", {"n": a.held})
            r["outbox_rows"] = int(c.exec_driver_sql(f"SELECT count(*) FROM {table} WHERE published_at_ms IS NULL")
                                   .scalar() or 0)
        r["outbox_rss_mb"] = round(worker_rss(env, queue, logs / "w1.log", a.settle) / 2**20, 1)
        print(f"outbox ({r['outbox_rows']} held rows): {r['outbox_rss_mb']} MB")
        with publishing_directly(mark.app):
            for _ in range(a.direct):
                mark.apply_async(("direct", 0), countdown=3600)
        client = redis.Redis.from_url(REDIS_URL)
        try:
            r["broker_eta_rss_mb"] = round(worker_rss(env, queue, logs / "w2.log", a.settle,
                                                      drained=lambda: client.llen(queue) == 0) / 2**20, 1)
        finally:  # the stopped worker gave its unacked eta messages back to the queue: drop them
            with Connection(REDIS_URL) as conn:
                Queue(queue, Exchange(queue), routing_key=queue)(conn.channel()).delete()
            client.delete(queue)
            r["left_on_broker"] = int(client.llen(queue))
        print(f"broker eta ({a.direct} messages held by the worker): {r['broker_eta_rss_mb']} MB")
        engine.dispose()
        outbox.close()
    r["outbox_delta_mb"] = round(r["outbox_rss_mb"] - r["empty_rss_mb"], 1)
    r["broker_eta_delta_mb"] = round(r["broker_eta_rss_mb"] - r["empty_rss_mb"], 1)
    r["broker_eta_kb_per_task"] = round(r["broker_eta_delta_mb"] * 1024 / a.direct, 2)
    r["outbox_kb_per_task"] = round(r["outbox_delta_mb"] * 1024 / a.held, 4)
    print(f"per pending task: outbox {r['outbox_kb_per_task']} KB, broker eta {r['broker_eta_kb_per_task']} KB")
    write_result("scheduled_memory", r)


if __name__ == "__main__":
    main()
