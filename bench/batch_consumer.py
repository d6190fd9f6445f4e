"""The search effect at saturation: a batch consumer vs plain Celery doing the same effect one task per message.

Two real workers (prefork, ``-c 2``, the deployment's recommended Celery configuration with
``worker_prefetch_multiplier`` raised to ``--prefetch`` for BOTH, RabbitMQ, Postgres) run side by side on
queues of their own:

- ``batch``: ``@outbox.consumer("OrderPlaced", name="searchb", batch_size=--batch-size, batch_wait_ms=--batch-wait-ms)``,
  whose handler upserts every search document of the batch in ONE statement; the library's whole path per
  message (strategy gate, batch buffer, one inbox claim statement per batch, one commit per batch, an ack each);
- ``plain``: a plain Celery task per message (``acks_late``) that upserts its one document and commits: no
  inbox, no gate, no dead letters;
- ``batches``: celery-batches (``celery_batches.Batches``, ``flush_every=--batch-size``, ``flush_interval``
  ``--batch-wait-ms``, ``acks_late``): the same bulk upsert of a batch and one commit, no inbox, no gate, no dead letters.
  Left out when ``celery_batches`` is not installed: it is not a dependency, since its releases (0.11) cap
  Celery below 5.7, which this project requires; ``pip install --no-deps celery-batches==0.11`` puts it in
  (it ran on Celery 5.7.0 here).

The documents and the upsert are the reference deployment's (``consumers/search.py``: one statement per
batch, guarded by the version), in ``search_documents``. Each round publishes N messages to one worker (the
batch one exactly as the relay publishes, the others with ``send_task``) and waits for its N documents;
CPU (utime + stime from ``/proc``) of the worker parent, its pool children, their Postgres backends and the
broker, before and after. The modes' order rotates from round to round after a warm-up; medians printed
with the ratios, written to ``bench/results/batch_consumer.json``.

    flock /tmp/heavy.lock .venv/bin/python bench/batch_consumer.py [--deliveries 2000] [--rounds 3] [--batch-size 100]

``--latency``: instead, the latency cost of batching at a trickle. One worker of the batch app consumes the batch
consumer and an unbatched ``@outbox.consumer`` with the same (one-document) upsert; messages go to both at
``--rate`` per second each for ``--seconds``; per message, publish -> its effect's start (the document's
``updated_at_ms``, ``effect_now_ms``: after the batch's wait); p50 / p99 of each and their ratio. Writes
``bench/results/batch_consumer_latency.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
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
from bench.consumer_cpu import BROKER_URL, PROCESSES, Worker, delta_ms  # noqa: E402

CONSUMER = "searchb"
SINGLE = "searchs"  # the unbatched twin (``--latency``)
PLAIN_TASK = "bench.plain_search"
BATCHES_TASK = "bench.batches_search"
MODES = ("batch", "plain", "batches")


def have_celery_batches() -> bool:
    try:
        import celery_batches  # noqa: F401
    except ImportError:
        return False
    return True


def __getattr__(name: str) -> Any:
    """``celery -A bench.batch_consumer:batch`` / ``:plain``: the two apps, built from the environment on demand."""
    if name == "batch":
        return _batch_app()
    if name == "plain":
        return _plain_app()
    if name == "batches":
        return _batches_app()
    raise AttributeError(name)


def _config(settings: Any) -> dict[str, Any]:
    from celery_outbox import recommended_celery_config

    conf = recommended_celery_config(settings, os.environ["BENCH_BROKER_URL"], dedicated=True)
    conf["worker_prefetch_multiplier"] = int(os.environ["BENCH_PREFETCH"])
    return conf


def _batch_app() -> Any:
    from celery import Celery
    from sqlalchemy.orm import Session

    from celery_outbox import Envelope, Outbox
    from celery_outbox.settings import Settings
    from consumers.search import upsert_documents

    settings = Settings.from_env()
    app = Celery("batch")
    app.conf.update(_config(settings))
    outbox = Outbox(app, settings=settings)

    @outbox.consumer("OrderPlaced", name=CONSUMER, batch_size=int(os.environ["BENCH_BATCH_SIZE"]),
                     batch_wait_ms=int(os.environ["BENCH_BATCH_WAIT_MS"]))
    def index(session: Session, events: list[Envelope]) -> None:
        upsert_documents(session, events)

    @outbox.consumer("OrderPlaced", name=SINGLE)
    def index_one(session: Session, envelope: Envelope) -> None:
        upsert_documents(session, [envelope])

    return app


def _twin_app(mode: str, db_env: str) -> tuple[Any, Any]:
    """A plain Celery app of ``mode`` on its own queue, and a function that gives the upsert a session:
    one engine per pool process, made after the fork."""
    from celery import Celery

    from celery_outbox.db import make_engine, make_session_factory
    from celery_outbox.settings import Settings

    settings = Settings(database_url=os.environ[db_env], namespace=os.environ["BENCH_NAMESPACE"])
    app = Celery(mode)
    app.conf.update(_config(settings))
    app.conf.task_queues = [plain_queue(settings.namespace, mode)]
    holder: dict[str, Any] = {}

    def session() -> Any:
        if "sessions" not in holder:
            holder["sessions"] = make_session_factory(make_engine(settings.effective_database_url))
        return holder["sessions"]()

    return app, session


def _plain_app() -> Any:
    from celery_outbox.messages import Envelope
    from consumers.search import upsert_documents

    app, session = _twin_app("plain", "BENCH_DB_URL")

    @app.task(name=PLAIN_TASK, acks_late=True, ignore_result=True)  # type: ignore[untyped-decorator]
    def index(body: dict[str, Any]) -> str:
        with session() as s:
            upsert_documents(s, [Envelope.from_dict(body)])
            s.commit()
        return "processed"

    return app


def _batches_app() -> Any:
    from celery_batches import Batches

    from celery_outbox.messages import Envelope
    from consumers.search import upsert_documents

    app, session = _twin_app("batches", "BENCH_DB_URL_BATCHES")

    @app.task(base=Batches, name=BATCHES_TASK, flush_every=int(os.environ["BENCH_BATCH_SIZE"]),
              flush_interval=int(os.environ["BENCH_BATCH_WAIT_MS"]) / 1000,
              acks_late=True, ignore_result=True)  # type: ignore[untyped-decorator]
    def index(requests: list[Any]) -> None:
        with session() as s:
            upsert_documents(s, [Envelope.from_dict(r.args[0]) for r in requests])
            s.commit()

    return app


def plain_queue(namespace: str, mode: str) -> Queue:
    return Queue(f"{namespace}.{mode}", Exchange(f"{namespace}.{mode}", type="direct", durable=True),
                 routing_key=f"{namespace}.{mode}", durable=True)


@contextmanager
def workers(url: str, namespace: str, home: Path, args: argparse.Namespace,
            modes: tuple[str, ...]) -> Iterator[Mapping[str, Worker]]:
    env = {**os.environ, "OUTBOX_DATABASE_URL": url + "?application_name=bench_batch_worker",
           "OUTBOX_BROKER_URL": BROKER_URL, "OUTBOX_NAMESPACE": namespace, "OUTBOX_HOME": str(home),
           "BENCH_DB_URL": url + "?application_name=bench_plain_worker",
           "BENCH_DB_URL_BATCHES": url + "?application_name=bench_batches_worker", "BENCH_BROKER_URL": BROKER_URL,
           "BENCH_NAMESPACE": namespace, "BENCH_BATCH_SIZE": str(args.batch_size), "BENCH_PREFETCH": str(args.prefetch),
           "BENCH_BATCH_WAIT_MS": str(args.batch_wait_ms)}
    env.pop("OUTBOX_CRASH_POINTS", None)
    queue = {"batch": f"{namespace}.{CONSUMER}", "plain": f"{namespace}.plain", "batches": f"{namespace}.batches"}
    started = {mode: Worker(mode=mode, app=f"bench.batch_consumer:{mode}", queue=queue[mode], env=env,
                            log=home / f"{mode}.log", app_name=f"bench_{mode}_worker") for mode in modes}
    with consuming(started, broker_url=BROKER_URL, queues=list(queue.values()),
                   exchanges=(f"{namespace}.events", f"{namespace}.plain", f"{namespace}.batches",
                              f"{namespace}.relay")) as running:
        yield running


def latency(args: argparse.Namespace) -> None:
    """``--latency`` (module docstring)."""
    import threading

    from celery_outbox.messages import celery_task_message
    from consumers.testing import order_placed_envelope

    namespace = f"batchlat{uuid.uuid4().hex[:8]}"
    sent: dict[str, float] = {}
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        from celery_outbox.db import make_engine

        engine = make_engine(url)
        env = {**os.environ, "OUTBOX_DATABASE_URL": url + "?application_name=bench_batch_worker",
               "OUTBOX_BROKER_URL": BROKER_URL, "OUTBOX_NAMESPACE": namespace, "OUTBOX_HOME": tmp,
               "BENCH_BROKER_URL": BROKER_URL, "BENCH_BATCH_SIZE": str(args.batch_size),
               "BENCH_BATCH_WAIT_MS": str(args.batch_wait_ms),
               "BENCH_PREFETCH": str(args.prefetch)}
        env.pop("OUTBOX_CRASH_POINTS", None)
        worker = Worker(mode="latency", app="bench.batch_consumer:batch",
                        queue=f"{namespace}.{CONSUMER},{namespace}.{SINGLE}", env=env, log=Path(tmp) / "w.log",
                        app_name="bench_batch_worker")
        try:
            with Connection(BROKER_URL) as conn:
                channel = conn.channel()

                def ready() -> bool:
                    try:
                        return all(channel.queue_declare(f"{namespace}.{c}", passive=True).consumer_count >= 1
                                   for c in (CONSUMER, SINGLE))
                    except Exception:
                        return False

                wait_until("the worker consuming", ready, worker, timeout_s=60)
                producer = Producer(conn.channel(), exchange=Exchange(f"{namespace}.events", type="direct",
                                                                      durable=True))
                total = int(args.rate * args.seconds)
                start = time.time()
                for i in range(total):  # open loop: message i of each consumer at start + i / rate
                    due = start + i / args.rate
                    pause = due - time.time()
                    if pause > 0:
                        threading.Event().wait(pause)
                    for consumer in (CONSUMER, SINGLE):
                        env_ = order_placed_envelope(f"{consumer}-{i}")
                        msg = celery_task_message(env_, consumer=consumer, routing_key=f"{namespace}.{consumer}")
                        sent[f"{consumer}-{i}"] = time.time() * 1000
                        producer.publish(msg.body, routing_key=msg.routing_key, headers=msg.headers,
                                         content_type="application/json", content_encoding="utf-8", delivery_mode=2,
                                         **msg.properties)

                def done() -> bool:
                    with engine.connect() as c:
                        return int(c.execute(sa.text("SELECT count(*) FROM search_documents")).scalar_one()) >= 2 * total

                wait_until("every effect", done, worker, timeout_s=120)
                with engine.connect() as c:
                    effects: dict[str, int] = {str(k): int(v) for k, v in c.execute(
                        sa.text("SELECT order_id, updated_at_ms FROM search_documents"))}
        finally:
            worker.stop()
            engine.dispose()
    from bench._common import percentile

    out: dict[str, dict[str, float]] = {}
    for consumer in (CONSUMER, SINGLE):
        ms = [float(effects[k]) - t for k, t in sent.items() if k.startswith(consumer + "-")]
        out[consumer] = {"n": len(ms), "p50_ms": round(percentile(ms, 50), 2), "p99_ms": round(percentile(ms, 99), 2)}
    ratio = out[CONSUMER]["p99_ms"] / out[SINGLE]["p99_ms"] if out[SINGLE]["p99_ms"] else float("nan")
    print(f"trickle {args.rate}/s per consumer for {args.seconds} s: publish -> effect start")
    for consumer, label in ((CONSUMER, f"batch (wait {args.batch_wait_ms} ms)"), (SINGLE, "unbatched")):
        print(f"{label:20} p50 {out[consumer]['p50_ms']:8.2f} ms  p99 {out[consumer]['p99_ms']:8.2f} ms")
    print(f"p99 ratio batch / unbatched: {ratio:.2f}")
    write_result("batch_consumer_latency", {"rate_per_consumer": args.rate, "seconds": args.seconds,
                                            "batch_size": args.batch_size,
                                            "batch_wait_ms": args.batch_wait_ms, "prefetch": args.prefetch,
                                            "latency": out,
                                            "p99_ratio": round(ratio, 3)})


def publish(mode: str, namespace: str, prefix: str, n: int, conn: Connection) -> None:
    from celery_outbox.messages import celery_task_message
    from consumers.testing import order_placed_envelope

    envelopes = [order_placed_envelope(f"{prefix}-{i}") for i in range(n)]
    if mode == "batch":
        producer = Producer(conn.channel(), exchange=Exchange(f"{namespace}.events", type="direct", durable=True))
        for env in envelopes:  # exactly as the relay publishes
            msg = celery_task_message(env, consumer=CONSUMER, routing_key=f"{namespace}.{CONSUMER}")
            producer.publish(msg.body, routing_key=msg.routing_key, headers=msg.headers,
                             content_type="application/json", content_encoding="utf-8", delivery_mode=2,
                             **msg.properties)
        return
    from celery import Celery

    app = Celery("plain-sender", broker=BROKER_URL)
    app.conf.update(task_serializer="json", accept_content=["json"])
    queue = plain_queue(namespace, mode)
    task = PLAIN_TASK if mode == "plain" else BATCHES_TASK
    with app.producer_or_acquire() as producer:
        for env in envelopes:
            app.send_task(task, args=[env.to_dict()], queue=queue, producer=producer)


def run_round(mode: str, worker: Worker, engine: sa.Engine, namespace: str, prefix: str, n: int,
              conn: Connection) -> dict[str, float]:
    def done() -> bool:
        with engine.connect() as c:
            return int(c.execute(sa.text("SELECT count(*) FROM search_documents WHERE order_id LIKE :p"),
                                 {"p": f"{prefix}-%"}).scalar_one()) >= n

    before = worker.sample(engine)
    t = time.perf_counter()
    publish(mode, namespace, prefix, n, conn)
    wait_until(f"{n} {mode} deliveries", done, worker)
    wall = time.perf_counter() - t
    cpu = delta_ms(before, worker.sample(engine))
    per = {k: v / n for k, v in cpu.items()}
    per["total"] = sum(per[k] for k in PROCESSES)
    per["total_without_broker"] = per["total"] - per["broker"]
    per["deliveries_per_s"] = n / wall
    return per


def batch_counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT name, sum(value) FROM outbox_counters WHERE consumer = :c GROUP BY name"),
                         {"c": CONSUMER}).all()
    out: dict[str, int] = {}
    for name, value in rows:
        base = str(name).split("#")[0]
        out[base] = out.get(base, 0) + int(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deliveries", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--batch-wait-ms", type=int, default=50, help="batch_wait_ms, and celery-batches' flush_interval")
    parser.add_argument("--prefetch", type=int, default=100, help="worker_prefetch_multiplier of both workers")
    parser.add_argument("--latency", action="store_true", help="the trickle latency instead (module docstring)")
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    if args.latency:
        latency(args)
        return
    n = args.deliveries
    modes = MODES if have_celery_batches() else MODES[:2]
    namespace = f"batchbench{uuid.uuid4().hex[:8]}"
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        from celery_outbox.db import make_engine

        engine = make_engine(url)
        with workers(url, namespace, Path(tmp), args, modes) as running, Connection(BROKER_URL) as conn:
            for mode in modes:  # warm-up: connections, pools, imports
                run_round(mode, running[mode], engine, namespace, f"warm-{mode}", max(100, n // 5), conn)
            for r in range(args.rounds):
                for mode in modes[r % len(modes):] + modes[:r % len(modes)]:  # each mode first in turn
                    per = run_round(mode, running[mode], engine, namespace, f"r{r}-{mode}", n, conn)
                    results[mode].append(per)
                    print(f"round {r + 1} {mode:7}: " + "  ".join(f"{k} {v:.3f}" for k, v in per.items()))
        counts = batch_counts(engine)
        engine.dispose()
    keys = [*PROCESSES, "total", "total_without_broker", "deliveries_per_s"]
    med = {m: {k: statistics.median(p[k] for p in results[m]) for k in keys} for m in modes}
    mean_size = counts.get("batched_messages", 0) / counts["batches"] if counts.get("batches") else float("nan")
    print(f"\nsearch effect: CPU ms per message, median of {args.rounds} rotated rounds of {n}, batch_size "
          f"{args.batch_size}, prefetch multiplier {args.prefetch} (machine shared); mean batch {mean_size:.1f}")
    print(f"{'process':22} " + " ".join(f"{m:>9}" for m in modes) + " " +
          " ".join(f"{m + '/batch':>14}" for m in modes[1:]))
    for k in keys:
        b = med["batch"][k]
        print(f"{k:22} " + " ".join(f"{med[m][k]:9.3f}" for m in modes) + " " +
              " ".join(f"{med[m][k] / b if b else float('nan'):14.2f}" for m in modes[1:]))
    ratios = {f"{m}_over_batch_cpu": round(med[m]["total"] / med["batch"]["total"], 4) for m in modes[1:]}
    ratios |= {f"batch_over_{m}_throughput": round(med["batch"]["deliveries_per_s"] / med[m]["deliveries_per_s"], 4)
               for m in modes[1:]}
    write_result("batch_consumer", {
        "deliveries_per_round": n, "rounds": args.rounds, "batch_size": args.batch_size, "prefetch": args.prefetch,
        "modes": list(modes), "median": med, "rounds_detail": results, "batch_counters": counts,
        "mean_batch_size": round(mean_size, 2), **ratios})

if __name__ == "__main__":
    main()
