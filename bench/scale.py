"""Scale: one relay batch with 0 vs 1,000,000 published rows in the outbox table.

The partial index ``ix_outbox_pending`` (``ix_<prefix>pending``, pending rows only) must keep the batch flat however much
history the table holds. Publishes into the in-memory publisher so only the database side is timed.
Prints both times, the ratio and the query plan; writes bench/results/scale.json.

    .venv/bin/python bench/scale.py [--history 1000000] [--batch 100] [--repeats 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

from bench._common import fresh_database, summary_ms, write_result
from celery_outbox.clock import SystemClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.relay.dispatch import dispatch_batch
from celery_outbox.relay.queries import due_pending
from celery_outbox.schema import Tables, define_tables
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings

PAYLOAD = ('{"order_id": "o", "customer_id": "c", "email": "a@b.cd", "currency": "EUR", "total_cents": 1, '
           '"lines": [{"sku": "s", "quantity": 1, "unit_price_cents": 1}]}')


def insert_rows(engine: sa.Engine, n: int, *, published: bool, start: int, tables: Tables) -> None:
    published_sql = "1" if published else "NULL"
    table = tables.table(tables.outbox).name
    with engine.begin() as c:
        c.exec_driver_sql(
            f"INSERT INTO {table} (message_id, type, payload, headers, created_at_ms, published_at_ms, attempts, "
            "next_attempt_at_ms) "
            f"SELECT md5(g::text || 'bench')::uuid, 'OrderPlaced', '{PAYLOAD}'::jsonb, '{{}}'::jsonb, g, "
            f"{published_sql}, 0, 0 FROM generate_series({start}, {start + n - 1}) AS g"
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.exec_driver_sql(f"VACUUM ANALYZE {table}")


def time_batches(engine: sa.Engine, *, batch: int, repeats: int, settings: Settings, tables: Tables) -> list[float]:
    """Each repeat: make ``batch`` rows pending again, then time one dispatch_batch over them."""
    sessions = make_session_factory(engine)
    clock = SystemClock()
    publisher = InMemoryPublisher()
    samples = []
    for _ in range(repeats + 3):
        with engine.begin() as c:
            c.execute(sa.update(tables.outbox).where(tables.outbox.created_at_ms < 0)
                      .values(published_at_ms=None, next_attempt_at_ms=0))
        with sessions() as s:
            t = time.perf_counter()
            result = dispatch_batch(s, publisher, clock, tables=tables, batch_size=batch, max_attempts=10, base_delay_ms=1000,
                                    max_delay_ms=60_000, routes=settings.routes,
                                    max_message_bytes=settings.max_message_bytes, namespace="bench")
            samples.append(time.perf_counter() - t)
        assert result.published == batch, result
        publisher.published.clear()
    return samples[3:]  # the first few warm caches and the connection pool


def plan(engine: sa.Engine, batch: int, *, tables: Tables) -> str:
    stmt = due_pending(SystemClock().now_ms(), batch, tables=tables, skip_locked=True)
    compiled = stmt.compile(engine, compile_kwargs={"literal_binds": True})
    with engine.connect() as c:
        rows = c.exec_driver_sql(f"EXPLAIN {compiled}").scalars().all()
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    settings = Settings()
    tables = define_tables(prefix=settings.table_prefix)
    with fresh_database() as url:
        engine = make_engine(url)
        # The batch's own rows carry negative created_at_ms so each repeat can re-pend exactly them.
        insert_rows(engine, args.batch, published=False, start=-args.batch, tables=tables)
        empty = time_batches(engine, batch=args.batch, repeats=args.repeats, settings=settings, tables=tables)
        t = time.perf_counter()
        insert_rows(engine, args.history, published=True, start=1, tables=tables)
        load_s = time.perf_counter() - t
        full = time_batches(engine, batch=args.batch, repeats=args.repeats, settings=settings, tables=tables)
        query_plan = plan(engine, args.batch, tables=tables)
        engine.dispose()
    e, f = summary_ms(empty), summary_ms(full)
    ratio = f["p50_ms"] / e["p50_ms"]
    print(f"batch of {args.batch}, 0 published rows         : p50 {e['p50_ms']:.2f} ms  mean {e['mean_ms']:.2f} ms")
    print(f"batch of {args.batch}, {args.history:,} published rows: p50 {f['p50_ms']:.2f} ms  "
          f"mean {f['mean_ms']:.2f} ms"
          f"  (loaded in {load_s:.1f}s)")
    print(f"ratio (p50) {ratio:.3f}x   ratio (mean) {f['mean_ms'] / e['mean_ms']:.3f}x")
    print("plan of the relay's query:\n" + query_plan)
    write_result("scale", {"batch": args.batch, "history_rows": args.history, "empty": e, "with_history": f,
                           "ratio_p50": round(ratio, 4), "ratio_mean": round(f["mean_ms"] / e["mean_ms"], 4),
                           "plan": query_plan})


if __name__ == "__main__":
    main()
