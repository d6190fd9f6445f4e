"""Scale: the relay with millions of published rows in the outbox, and while a prune deletes them.

Part A, one relay batch (``dispatch_batch`` into the in-memory publisher, so only the database side is
timed) in two databases side by side: one holding only the batch's rows, one also holding
``--history`` published rows (one ``INSERT ... SELECT generate_series``). Timed batches alternate between
the two databases (interleaved), medians compared; ``EXPLAIN (ANALYZE, BUFFERS)`` of the claim in both.
The partial index ``ix_outbox_pending`` (pending rows only) must keep the batch flat (target <= 1.1x).

Part B, relay throughput (a fresh default ``RelayLoop``, in-memory publisher) draining ``--drain-rows``
new rows, alternately alone and while ``ops.retention.prune`` deletes the published history in another
process (target >= 0.9 of alone). Rounds interleaved, medians compared.

Prints every figure and writes bench/results/scale.json.

    .venv/bin/python bench/scale.py [--history 10000000] [--batch 100] [--repeats 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

from bench._common import fresh_database, summary_ms, write_result
from celery_outbox.clock import SystemClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.ops import retention
from celery_outbox.relay.dispatch import dispatch_batch
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.relay.queries import due_pending
from celery_outbox.schema import Tables, define_tables
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings

PAYLOAD = ('{"order_id": "o", "customer_id": "c", "email": "a@b.cd", "currency": "EUR", "total_cents": 1, '
           '"lines": [{"sku": "s", "quantity": 1, "unit_price_cents": 1}]}')


def insert_rows(engine: sa.Engine, n: int, *, published: bool, start: int, tables: Tables, now_ms: int = 0,
                tag: str = "bench") -> None:
    """``n`` rows in ONE ``INSERT ... SELECT generate_series``; published ones at ``published_at_ms = 1``."""
    published_sql = "1" if published else "NULL"
    table = tables.table(tables.outbox).name
    with engine.begin() as c:
        c.exec_driver_sql("SET LOCAL statement_timeout = 0")  # millions of rows take longer than the default
        c.exec_driver_sql(
            f"INSERT INTO {table} (message_id, type, payload, headers, created_at_ms, published_at_ms, attempts, "
            "next_attempt_at_ms) "
            f"SELECT md5(g::text || '{tag}')::uuid, 'OrderPlaced', '{PAYLOAD}'::jsonb, '{{}}'::jsonb, "
            f"{now_ms} + g, {published_sql}, 0, 0 FROM generate_series({start}, {start + n - 1}) AS g"
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.exec_driver_sql("SET statement_timeout = 0")
        c.exec_driver_sql(f"VACUUM ANALYZE {table}")
        c.exec_driver_sql("RESET statement_timeout")


def one_batch(engine: sa.Engine, *, batch: int, settings: Settings, tables: Tables) -> float:
    """Make the first ``batch`` rows (seq 1..batch) pending again, then time one dispatch_batch over them."""
    with engine.begin() as c:
        c.execute(sa.update(tables.outbox).where(tables.outbox.seq <= batch)
                  .values(published_at_ms=None, next_attempt_at_ms=0))
    publisher = InMemoryPublisher()
    with make_session_factory(engine)() as s:
        t = time.perf_counter()
        result = dispatch_batch(s, publisher, SystemClock(), tables=tables, batch_size=batch, max_attempts=10,
                                base_delay_ms=1000, max_delay_ms=60_000, routes=settings.routes,
                                max_message_bytes=settings.max_message_bytes, namespace="bench")
        elapsed = time.perf_counter() - t
    assert result.published == batch, result
    return elapsed


def explain(engine: sa.Engine, batch: int, *, tables: Tables) -> tuple[str, float]:
    """EXPLAIN (ANALYZE, BUFFERS) of the claim (its locks end with the statement's own transaction)."""
    stmt = due_pending(SystemClock().now_ms(), batch, tables=tables, skip_locked=True)
    compiled = stmt.compile(engine, compile_kwargs={"literal_binds": True})
    with engine.begin() as c:
        c.execute(sa.update(tables.outbox).where(tables.outbox.seq <= batch)
                  .values(published_at_ms=None, next_attempt_at_ms=0))
    with engine.begin() as c:
        lines = c.exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS) {compiled}").scalars().all()
    with engine.begin() as c:  # published again, as the timed batches leave them
        c.execute(sa.update(tables.outbox).where(tables.outbox.seq <= batch).values(published_at_ms=1))
    took = next((float(line.split(":")[1].split()[0]) for line in lines if line.startswith("Execution Time")), -1.0)
    return "\n".join(lines), took


def drain_rate(engine: sa.Engine, *, rows: int, start: int, settings: Settings, tables: Tables) -> float:
    """Rows/s of a fresh default RelayLoop draining ``rows`` new pending rows."""
    insert_rows(engine, rows, published=False, start=start, tables=tables, now_ms=SystemClock().now_ms(),
                tag=f"drain{start}")
    loop = RelayLoop(settings=settings, tables=tables, session_factory=make_session_factory(engine),
                     publisher=InMemoryPublisher(), listen=False)
    published = 0
    t = time.perf_counter()
    while published < rows:
        published += loop.drain_once().published
    elapsed = time.perf_counter() - t
    loop.close()
    assert published == rows, (published, rows)
    return rows / elapsed


def prune_forever(url: str, prefix: str, counter: Any) -> None:
    """In its own process: prune published rows (older than a minute) until terminated."""
    tables = define_tables(prefix=prefix)
    engine = make_engine(url)
    sessions = make_session_factory(engine)

    def progress(p: retention.PruneProgress) -> None:
        with counter.get_lock():
            counter.value += p.deleted

    while True:
        retention.prune(sessions, tables=tables, inbox_older_than_ms=None, published_older_than_ms=60_000,
                        clock=SystemClock(), redelivery_window_ms=1, progress=progress)
        time.sleep(0.1)


def published_count(engine: sa.Engine, tables: Tables) -> int:
    with engine.connect() as c:
        return int(c.execute(sa.select(sa.func.count()).select_from(tables.outbox)
                             .where(tables.outbox.published_at_ms.is_not(None))).scalar_one())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=int, default=10_000_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--drain-rows", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    settings = Settings()
    tables = define_tables(prefix=settings.table_prefix)
    out: dict[str, Any] = {"batch": args.batch, "history_rows": args.history}
    with fresh_database() as empty_url, fresh_database() as full_url:
        empty, full = make_engine(empty_url), make_engine(full_url)
        # The batch's own rows come first (seq 1..batch) so each repeat can re-pend exactly them.
        for engine in (empty, full):
            insert_rows(engine, args.batch, published=False, start=-args.batch, tables=tables)
        t = time.perf_counter()
        insert_rows(full, args.history, published=True, start=1, tables=tables)
        load_s = time.perf_counter() - t
        print(f"loaded {args.history:,} published rows in {load_s:.1f}s (one INSERT ... SELECT generate_series)",
              flush=True)
        # -- A: one batch, 0 vs history, interleaved ----------------------------------------------------------
        samples: dict[str, list[float]] = {"empty": [], "full": []}
        for i in range(args.repeats + 3):
            for name, engine in (("empty", empty), ("full", full)):
                took = one_batch(engine, batch=args.batch, settings=settings, tables=tables)
                if i >= 3:  # the first few warm caches and the connection pool
                    samples[name].append(took)
        e, f = summary_ms(samples["empty"]), summary_ms(samples["full"])
        ratio = f["p50_ms"] / e["p50_ms"]
        plan_empty, exec_empty = explain(empty, args.batch, tables=tables)
        plan_full, exec_full = explain(full, args.batch, tables=tables)
        print(f"batch of {args.batch}, 0 published rows          : p50 {e['p50_ms']:.2f} ms  mean {e['mean_ms']:.2f} ms")
        print(f"batch of {args.batch}, {args.history:,} published rows: p50 {f['p50_ms']:.2f} ms  "
              f"mean {f['mean_ms']:.2f} ms")
        print(f"ratio (p50) {ratio:.3f}x   ratio (mean) {f['mean_ms'] / e['mean_ms']:.3f}x   (target <= 1.1x)")
        print(f"claim query, EXPLAIN ANALYZE execution time: {exec_empty:.3f} ms empty, {exec_full:.3f} ms with "
              f"history\n{plan_full}", flush=True)
        out.update({"load_s": round(load_s, 1), "empty": e, "with_history": f, "ratio_p50": round(ratio, 4),
                    "ratio_mean": round(f["mean_ms"] / e["mean_ms"], 4),
                    "claim_exec_ms": {"empty": exec_empty, "with_history": exec_full},
                    "plan_with_history": plan_full, "plan_empty": plan_empty})
        # -- B: relay throughput alone vs while a prune deletes the history, interleaved ----------------------
        ctx = multiprocessing.get_context("spawn")
        deleted = ctx.Value("q", 0)
        alone: list[float] = []
        pruning: list[float] = []
        start = args.history + 1
        before = published_count(full, tables)
        for _ in range(args.rounds):
            alone.append(drain_rate(full, rows=args.drain_rows, start=start, settings=settings, tables=tables))
            start += args.drain_rows
            pruner = ctx.Process(target=prune_forever, args=(full_url, settings.table_prefix, deleted), daemon=True)
            pruner.start()
            try:
                while deleted.value == 0 and pruner.is_alive():  # wait until the prune is really deleting
                    time.sleep(0.05)
                pruning.append(drain_rate(full, rows=args.drain_rows, start=start, settings=settings, tables=tables))
            finally:
                pruner.terminate()
                pruner.join(timeout=30)
            start += args.drain_rows
        a, p = statistics.median(alone), statistics.median(pruning)
        print(f"relay alone: {a:,.0f} rows/s, while pruning: {p:,.0f} rows/s, ratio {p / a:.3f} (target >= 0.9); "
              f"rows the prune deleted: {deleted.value:,} of {before:,} published "
              f"(runs alone {[round(x) for x in alone]}, pruning {[round(x) for x in pruning]})")
        out["prune"] = {"drain_rows": args.drain_rows, "rounds": args.rounds, "alone_rows_per_s": round(a),
                        "pruning_rows_per_s": round(p), "ratio": round(p / a, 4), "deleted_rows": deleted.value,
                        "published_rows_before": before, "alone_runs": [round(x) for x in alone],
                        "pruning_runs": [round(x) for x in pruning]}
        empty.dispose()
        full.dispose()
    write_result("scale", out)


if __name__ == "__main__":
    main()
