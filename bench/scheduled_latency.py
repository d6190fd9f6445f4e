"""Due-time latency of tasks held in the outbox vs immediate tasks, with a real relay and worker.

Postgres (a fresh database), the shared Redis broker, ``outbox relay`` (LISTEN/NOTIFY, default settings)
and one ``celery worker`` (solo pool) of ``bench/_sched_app.py``. At ``--rate`` per second this script
commits, alternately, an immediate task (``due`` = just before its commit) and a task with an eta
``--countdown`` seconds ahead (held as a row, ``due`` = the eta). The task records when it started
(``ran_at``). Latency = ran_at - due, per kind; prints p50/p99 and the held/immediate ratios; writes
bench/results/scheduled_latency.json. The first ``--warmup`` tasks of each kind are dropped.

    .venv/bin/python bench/scheduled_latency.py [--tasks 200] [--rate 10] [--countdown 3] [--warmup 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from bench._common import fresh_database, percentile, write_result
from celery_outbox.clock import SystemClock
from devtools.processes import Child, wait_until

ROOT = Path(__file__).resolve().parent.parent

BIN = Path(sys.executable).parent
REDIS_URL = os.environ.get("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def stats(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99),
            "max_ms": max(values) if values else float("nan")}


def run(url: str, a: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    queue = f"schedbench.{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({"SCHEDBENCH_DATABASE_URL": url, "SCHEDBENCH_BROKER_URL": REDIS_URL, "SCHEDBENCH_QUEUE": queue,
                "PYTHONPATH": str(ROOT)})
    os.environ.update({k: env[k] for k in ("SCHEDBENCH_DATABASE_URL", "SCHEDBENCH_BROKER_URL", "SCHEDBENCH_QUEUE")})
    from bench import _sched_app
    outbox, mark = _sched_app.build(url, REDIS_URL, queue)
    engine = sa.create_engine(url)
    _sched_app.RUNS.metadata.create_all(engine)
    sessions = sessionmaker(engine)
    worker = Child(name="worker", cwd=ROOT, env=env, log_path=log_dir / "worker.log", argv=[
        sys.executable, "-m", "celery", "-A", "bench._sched_app", "worker", "-Q", queue, "-P", "solo",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING"]).start()
    relay = Child(name="relay", cwd=ROOT, env=env, log_path=log_dir / "relay.log",
                  argv=[str(BIN / "outbox"), "-A", "bench._sched_app", "relay"]).start()
    clock = SystemClock()
    try:
        time.sleep(5)  # both processes up
        start = time.perf_counter()
        for i in range(a.tasks):
            held = i % 2 == 1
            with sessions.begin() as s, outbox.transaction(s):
                if held:
                    due = clock.now_ms() + int(a.countdown * 1000)
                    mark.apply_async(("held", due), eta=datetime.fromtimestamp(due / 1000, UTC))
                else:
                    mark.apply_async(("immediate", clock.now_ms()))
            time.sleep(max(0.0, start + (i + 1) / a.rate - time.perf_counter()))

        def done() -> int:
            with engine.connect() as c:
                return int(c.scalar(sa.select(sa.func.count()).select_from(_sched_app.RUNS)) or 0)

        if not wait_until(lambda: done() >= a.tasks, timeout_s=a.countdown + 120):
            raise SystemExit(f"only {done()} of {a.tasks} ran\n{worker.log_tail()}\n{relay.log_tail()}")
        with engine.connect() as c:
            rows = c.execute(sa.select(_sched_app.RUNS.c.kind, _sched_app.RUNS.c.due_ms, _sched_app.RUNS.c.ran_at_ms)
                             .order_by(_sched_app.RUNS.c.due_ms)).all()
    finally:
        relay.stop()
        worker.stop()
        engine.dispose()
        outbox.close()
    out: dict[str, Any] = {}
    for kind in ("immediate", "held"):
        lat = [float(r - d) for k, d, r in rows if k == kind][a.warmup:]
        out[kind] = stats(lat)
        out[kind]["early"] = sum(1 for v in lat if v < 0)  # ran before due: must be 0 for held tasks
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=200)
    p.add_argument("--rate", type=float, default=10.0)
    p.add_argument("--countdown", type=float, default=3.0)
    p.add_argument("--warmup", type=int, default=10)
    a = p.parse_args()
    import tempfile
    with tempfile.TemporaryDirectory() as tmp, fresh_database("outbox_schedlat") as url:
        r = run(url, a, Path(tmp))
    r["ratio_p50"] = round(r["held"]["p50_ms"] / max(r["immediate"]["p50_ms"], 1.0), 3)
    r["ratio_p99"] = round(r["held"]["p99_ms"] / max(r["immediate"]["p99_ms"], 1.0), 3)
    r.update({"tasks": a.tasks, "rate_per_s": a.rate, "countdown_s": a.countdown, "broker": "redis",
              "database": "postgres", "relay": "outbox relay (LISTEN/NOTIFY)", "worker": "solo"})
    for kind in ("immediate", "held"):
        s = r[kind]
        print(f"{kind:9s} n={s['n']} p50={s['p50_ms']:.0f} ms p99={s['p99_ms']:.0f} ms max={s['max_ms']:.0f} ms "
              f"early={s['early']}")
    print(f"held/immediate: p50 x{r['ratio_p50']}, p99 x{r['ratio_p99']}")
    write_result("scheduled_latency", r)


if __name__ == "__main__":
    main()
