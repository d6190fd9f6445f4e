"""Relay throughput on RabbitMQ, as a ratio against the broker's own batched durable publish rate.

For each batch size (default 1, 10, 100, 500), in the same run:
  ceiling: KombuPublisher.publish_batch on prebuilt task messages, no database (the broker's rate
           with the same confirm mode, same batch size);
  relay:   dispatch_batch draining N fresh Postgres outbox rows (claim SKIP LOCKED, publish, one
           UPDATE, one commit per batch);
plus the seed's one-commit-per-message design (claim one row, publish with its own confirm, mark,
commit), which is ``batch 1`` of the relay. Prints ratios and writes JSON to bench/results/.

    .venv/bin/python bench/relay_throughput.py [--rows 3000] [--consumers 3] [--confirm-mode confirm]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa
from kombu import Connection, Exchange, Queue

from celery_outbox.celery.kombu_publisher import KombuPublisher
from celery_outbox.clock import SystemClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.messages import Envelope, celery_task_message
from celery_outbox.relay.dispatch import dispatch_with_settings
from celery_outbox.schema import Tables, define_tables
from celeryconfig import Settings
from orders import migrate

CONSUMERS = ("shipping", "billing", "search", "email")


def purge(url: str, settings: Settings, *, delete: bool = False) -> None:
    with Connection(url) as conn:
        ch = conn.channel()
        for c in settings.consumers:
            q = Queue(settings.queue_name(c), no_declare=True)(ch)
            q.delete() if delete else q.purge()
        if delete:
            Exchange(settings.exchange_name)(ch).delete()


def ceiling(url: str, settings: Settings, rows: int, batch: int) -> float:
    """Broker messages per second through the publisher alone (no database)."""
    envs = [Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload={"order_id": f"o-{i}", "n": i})
            for i in range(rows)]
    msgs = [celery_task_message(e, consumer=c, routing_key=settings.queue_name(c))
            for e in envs for c in settings.consumers]
    with KombuPublisher(broker_url=url, settings=settings) as pub:
        pub.publish_batch(msgs[:1])  # connect and declare outside the timing
        per_batch = batch * len(settings.consumers)
        start = time.perf_counter()
        for i in range(0, len(msgs), per_batch):
            report = pub.publish_batch(msgs[i:i + per_batch])
            assert not report.rejected, report.rejected
        elapsed = time.perf_counter() - start
    return len(msgs) / elapsed


def relay_rate(url: str, settings: Settings, sessions: Any, rows: int, batch: int, *,
               tables: Tables) -> tuple[float, float]:
    now = SystemClock().now_ms()
    with sessions() as s:
        s.execute(sa.delete(tables.outbox))
        s.execute(sa.insert(tables.outbox), [
            {"message_id": uuid.uuid4(), "type": "OrderPlaced", "payload": {"order_id": f"o-{i}", "n": i},
             "headers": {}, "created_at_ms": now, "next_attempt_at_ms": now, "attempts": 0}
            for i in range(rows)])
        s.commit()
    clock = SystemClock()
    with KombuPublisher(broker_url=url, settings=settings) as pub:
        pub.publish_batch([])
        published = 0
        start = time.perf_counter()
        while True:
            with sessions() as s:
                r = dispatch_with_settings(s, pub, clock, settings, tables=tables, batch_size=batch)
            assert not r.broker_unavailable and r.failed == 0, r
            published += r.published
            if r.claimed == 0:
                break
        elapsed = time.perf_counter() - start
    assert published == rows, (published, rows)
    return rows * len(settings.consumers) / elapsed, rows / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--broker-url", default="amqp://guest:guest@127.0.0.1:5672//")
    ap.add_argument("--pg-admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--consumers", type=int, default=3, choices=range(1, 5))
    ap.add_argument("--batch-sizes", default="1,10,100,500")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs per batch size (medians reported)")
    ap.add_argument("--confirm-mode", default="confirm", choices=["confirm", "tx", "none"])
    args = ap.parse_args()

    db = f"outbox_bench_{uuid.uuid4().hex[:8]}"
    admin = make_engine(args.pg_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{db}"')
    url = args.pg_admin_url.rsplit("/", 1)[0] + f"/{db}"
    settings = Settings(namespace=f"bench{uuid.uuid4().hex[:6]}", broker_url=args.broker_url, database_url=url,
                        routes={"OrderPlaced": CONSUMERS[:args.consumers]}, relay_confirm_mode=args.confirm_mode)
    tables = define_tables(prefix=settings.table_prefix)
    results: list[dict[str, Any]] = []
    try:
        migrate.upgrade(url)
        engine = make_engine(url)
        sessions = make_session_factory(engine)
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            n = min(args.rows, 600) if batch == 1 else args.rows  # batch 1 is slow; keep the run short
            # Interleave ceiling and relay runs and keep the medians: one noisy run on a shared 2-core
            # machine must not decide the ratio.
            ceils, rates = [], []
            for _ in range(args.repeat):
                ceils.append(ceiling(args.broker_url, settings, n, batch))
                purge(args.broker_url, settings)
                rates.append(relay_rate(args.broker_url, settings, sessions, n, batch, tables=tables))
                purge(args.broker_url, settings)
            ceil = statistics.median(ceils)
            msgs_s = statistics.median(r[0] for r in rates)
            rows_s = statistics.median(r[1] for r in rates)
            row = {"batch_size": batch, "rows": n, "consumers": args.consumers, "confirm_mode": args.confirm_mode,
                   "ceiling_msgs_per_s": round(ceil), "relay_msgs_per_s": round(msgs_s),
                   "relay_rows_per_s": round(rows_s), "ratio": round(msgs_s / ceil, 3),
                   "repeat": args.repeat}
            results.append(row)
            print(f"batch {batch:>4}: ceiling {ceil:>8.0f} msg/s  relay {msgs_s:>8.0f} msg/s "
                  f"({rows_s:>7.0f} rows/s)  ratio {msgs_s / ceil:.2f}", flush=True)
        base = next((r for r in results if r["batch_size"] == 1), None)
        if base is not None:
            for r in results:
                r["speedup_vs_one_commit_per_message"] = round(r["relay_rows_per_s"] / base["relay_rows_per_s"], 1)
            print("speed-up vs one commit per message (batch 1): "
                  + ", ".join(f"{r['batch_size']}: x{r['speedup_vs_one_commit_per_message']}" for r in results))
        engine.dispose()
    finally:
        purge(args.broker_url, settings, delete=True)
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        admin.dispose()
    out = Path(__file__).resolve().parent / "results" / f"relay_throughput_{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "relay_throughput", "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
