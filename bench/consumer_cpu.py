"""CPU per delivery, by process: the outbox consumer task vs the same effect as a plain Celery task.

Two real workers (prefork, 2 processes, the deployment's recommended Celery configuration, RabbitMQ,
Postgres) run side by side on queues of their own: one runs one of the reference deployment's
consumers (``celery -A relay.app``: strategy, delivery, inbox claim + effect + commit; ``--consumer``,
default ``shipping``), the other a plain Celery task doing the same effect (the consumer's ``prepare``
step if it has one, then its handler, then commit: no inbox, no ordering, no strategy). Each round
publishes N messages to one worker and waits for its N effect rows, reading CPU time
(utime + stime from ``/proc/<pid>/stat``) before and after for: the worker parent, its pool
children, their Postgres backends (``pg_stat_activity`` by ``application_name``) and the RabbitMQ
broker (``beam.smp``). Modes alternate A-B / B-A over the rounds after a warm-up; medians are printed
with the ratio outbox / plain, and written to bench/results/consumer_cpu.json.

The broker's figure includes whatever else uses that RabbitMQ at the time (other test runs).

    .venv/bin/python bench/consumer_cpu.py [--consumer shipping|billing|search] [--deliveries 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402
from kombu import Connection, Exchange, Producer, Queue  # noqa: E402

from bench._common import consuming, fresh_database, wait_until, write_result  # noqa: E402

CELERY = str(Path(sys.executable).parent / "celery")
BROKER_URL = os.environ.get("OUTBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")
PLAIN_TASK = "bench.plain_shipping"
TICKS = os.sysconf("SC_CLK_TCK")
PROCESSES = ("worker_parent", "worker_children", "pg_backends", "broker")
MODES = ("outbox", "plain")
# Where each consumer's effect lands: (table, column, LIKE pattern of a round's prefix).
EFFECTS = {"shipping": ("shipments", "order_id", "{}-%"), "billing": ("invoices", "order_id", "{}-%"),
           "search": ("search_documents", "order_id", "{}-%"), "email": ("sent_emails", "subject", "Order {}-% confirmed")}


def __getattr__(name: str) -> Any:
    """``celery -A bench.consumer_cpu:plain``: the plain Celery app, built from the environment on demand."""
    if name == "plain":
        return _plain_app()
    raise AttributeError(name)


def _plain_app() -> Any:
    """Plain Celery: the same configuration and the same Shipment effect, no outbox machinery."""
    from celery import Celery

    from celery_outbox import recommended_celery_config
    from celery_outbox.db import make_engine, make_session_factory
    from celery_outbox.messages import Envelope
    from celeryconfig import Settings
    from consumers import default_registry

    settings = Settings(database_url=os.environ["BENCH_DB_URL"], namespace=os.environ["BENCH_NAMESPACE"])
    app = Celery("plain")
    app.conf.update(recommended_celery_config(settings, os.environ["BENCH_BROKER_URL"], dedicated=True))
    app.conf.task_queues = [plain_queue(settings.namespace)]
    spec = default_registry()[os.environ["BENCH_CONSUMER"]]
    holder: dict[str, Any] = {}

    @app.task(name=PLAIN_TASK, acks_late=True, ignore_result=True)  # type: ignore[untyped-decorator]
    def ship(body: dict[str, Any]) -> str:
        if "sessions" not in holder:  # one engine per pool process, made after the fork
            holder["sessions"] = make_session_factory(make_engine(settings.effective_database_url))
        envelope = Envelope.from_dict(body)
        with holder["sessions"]() as session:
            if spec.prepare is not None:
                spec.prepare(session, envelope)
            spec.handler(session, envelope)
            session.commit()
        return "processed"

    return app


def plain_queue(namespace: str) -> Queue:
    return Queue(f"{namespace}.plain", Exchange(f"{namespace}.plain", type="direct", durable=True),
                 routing_key=f"{namespace}.plain", durable=True)


def cpu_ticks(pid: int) -> int:
    """utime + stime of ``pid`` in clock ticks (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0
    return int(fields[11]) + int(fields[12])


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    return out


def broker_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "beam.smp":
                    pids.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return pids


class Worker:
    """One ``celery worker`` process group and what it costs."""

    def __init__(self, *, mode: str, app: str, queue: str, env: dict[str, str], log: Path, app_name: str,
                 cwd: Path = ROOT) -> None:
        """``cwd``: the source tree the worker runs from (another commit's, for an A/B: bench/batch_consumer_ab.py)."""
        self.mode, self.queue, self.app_name = mode, queue, app_name
        argv = [CELERY, "-A", app, "worker", "-Q", queue, "-P", "prefork", "-c", "2", "--without-gossip",
                "--without-mingle", "--without-heartbeat", "-l", "WARNING", "-n", f"{mode}-{uuid.uuid4().hex[:6]}@%h"]
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def sample(self, engine: sa.Engine) -> dict[str, dict[int, int]]:
        with engine.connect() as c:
            backends = c.execute(sa.text("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                         "AND application_name = :a"), {"a": self.app_name}).scalars().all()
        return {"worker_parent": {self.proc.pid: cpu_ticks(self.proc.pid)},
                "worker_children": {p: cpu_ticks(p) for p in children_of(self.proc.pid)},
                "pg_backends": {int(p): cpu_ticks(int(p)) for p in backends},
                "broker": {p: cpu_ticks(p) for p in broker_pids()}}

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def delta_ms(before: dict[str, dict[int, int]], after: dict[str, dict[int, int]]) -> dict[str, float]:
    """CPU milliseconds per process kind between two samples (a process new since ``before`` counts from 0)."""
    return {kind: sum(t - before[kind].get(pid, 0) for pid, t in after[kind].items()) * 1000 / TICKS
            for kind in PROCESSES}


@contextmanager
def workers(url: str, namespace: str, home: Path, consumer: str) -> Iterator[Mapping[str, Worker]]:
    env = {**os.environ, "OUTBOX_DATABASE_URL": url + "?application_name=bench_outbox_worker",
           "OUTBOX_BROKER_URL": BROKER_URL, "OUTBOX_NAMESPACE": namespace, "OUTBOX_HOME": str(home),
           "BENCH_DB_URL": url + "?application_name=bench_plain_worker", "BENCH_BROKER_URL": BROKER_URL,
           "BENCH_NAMESPACE": namespace, "BENCH_CONSUMER": consumer}
    env.pop("OUTBOX_CRASH_POINTS", None)
    started = {
        "outbox": Worker(mode="outbox", app="relay.app", queue=f"{namespace}.{consumer}", env=env,
                         log=home / "outbox.log", app_name="bench_outbox_worker"),
        "plain": Worker(mode="plain", app="bench.consumer_cpu:plain", queue=f"{namespace}.plain", env=env,
                        log=home / "plain.log", app_name="bench_plain_worker"),
    }
    with consuming(started, broker_url=BROKER_URL, queues=(f"{namespace}.{consumer}", f"{namespace}.plain"),
                   exchanges=(f"{namespace}.events", f"{namespace}.plain", f"{namespace}.relay")) as running:
        yield running


def publish(mode: str, namespace: str, consumer: str, prefix: str, n: int, conn: Connection) -> None:
    from celery_outbox.messages import celery_task_message
    from consumers.testing import order_placed_envelope

    envelopes = [order_placed_envelope(f"{prefix}-{i}") for i in range(n)]
    if mode == "outbox":
        producer = Producer(conn.channel(), exchange=Exchange(f"{namespace}.events", type="direct", durable=True))
        for env in envelopes:  # exactly as the relay publishes (tests/integration/test_consumer_worker.py)
            msg = celery_task_message(env, consumer=consumer, routing_key=f"{namespace}.{consumer}")
            producer.publish(msg.body, routing_key=msg.routing_key, headers=msg.headers,
                             content_type="application/json", content_encoding="utf-8", delivery_mode=2,
                             **msg.properties)
        return
    from celery import Celery

    app = Celery("plain-sender", broker=BROKER_URL)
    app.conf.update(task_serializer="json", accept_content=["json"])
    queue = plain_queue(namespace)
    with app.producer_or_acquire() as producer:
        for env in envelopes:  # plain Celery: .delay() of the envelope dict after the commit
            app.send_task(PLAIN_TASK, args=[env.to_dict()], queue=queue, producer=producer)


def run_round(mode: str, worker: Worker, engine: sa.Engine, namespace: str, consumer: str, prefix: str, n: int,
              conn: Connection) -> dict[str, float]:
    table, column, pattern = EFFECTS[consumer]

    def done() -> bool:
        with engine.connect() as c:
            return int(c.execute(sa.text(f"SELECT count(*) FROM {table} WHERE {column} LIKE :p"),
                                 {"p": pattern.format(prefix)}).scalar_one()) >= n

    before = worker.sample(engine)
    t = time.perf_counter()
    publish(mode, namespace, consumer, prefix, n, conn)
    wait_until(f"{n} {mode} deliveries", done, worker)
    wall = time.perf_counter() - t
    cpu = delta_ms(before, worker.sample(engine))
    per = {k: v / n for k, v in cpu.items()}
    per["total"] = sum(per[k] for k in PROCESSES)
    per["deliveries_per_s"] = n / wall
    return per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    from consumers import default_registry

    # The consumers the deployment's worker registers (``consumers.register``) whose effect this bench can count.
    parser.add_argument("--consumer", choices=sorted(set(EFFECTS) & set(default_registry().names())), default="shipping")
    parser.add_argument("--deliveries", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    n = args.deliveries
    namespace = f"cpubench{uuid.uuid4().hex[:8]}"
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        from celery_outbox.db import make_engine

        engine = make_engine(url)
        with workers(url, namespace, Path(tmp), args.consumer) as running, Connection(BROKER_URL) as conn:
            for mode in MODES:  # warm-up: connections, pools, imports
                run_round(mode, running[mode], engine, namespace, args.consumer, f"warm-{mode}", max(50, n // 5), conn)
            for r in range(args.rounds):
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    per = run_round(mode, running[mode], engine, namespace, args.consumer, f"r{r}-{mode}", n, conn)
                    results[mode].append(per)
                    print(f"round {r + 1} {mode:6}: " + "  ".join(f"{k} {v:.3f}" for k, v in per.items()))
        engine.dispose()
    keys = [*PROCESSES, "total", "deliveries_per_s"]
    med = {m: {k: statistics.median(p[k] for p in results[m]) for k in keys} for m in MODES}
    print(f"\n{args.consumer}: CPU ms per delivery, median of {args.rounds} interleaved rounds of {n} (machine shared):")
    print(f"{'process':18} {'outbox':>9} {'plain':>9} {'diff':>9} {'ratio':>7}")
    for k in keys:
        o, p = med["outbox"][k], med["plain"][k]
        print(f"{k:18} {o:9.3f} {p:9.3f} {o - p:9.3f} {o / p if p else float('nan'):7.2f}")
    name = "consumer_cpu" if args.consumer == "shipping" else f"consumer_cpu_{args.consumer}"
    write_result(name, {"consumer": args.consumer, "deliveries_per_round": n, "rounds": args.rounds, "median": med,
                        "rounds_detail": results,
                        "ratio_total_cpu": round(med["outbox"]["total"] / med["plain"]["total"], 4),
                        "ratio_throughput": round(med["outbox"]["deliveries_per_s"] / med["plain"]["deliveries_per_s"], 4)})


if __name__ == "__main__":
    main()
