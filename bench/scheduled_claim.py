"""The relay's claim with scheduled (not yet due) rows held in the outbox, on Postgres.

Phase "none": ``--due`` due rows only. Phase "held": the same number of due rows written AFTER
``--future`` rows due in a day (so every held row has a lower seq than every due row: the worst case
for a claim that walked the pending rows in seq order). In each phase: ``EXPLAIN (ANALYZE, BUFFERS)``
of the claim, the claim alone (``--claims`` times, rolled back), then full relay batches
(``dispatch_batch``: claim, publish to the in-memory publisher, mark, commit) until the due rows are
gone. Prints medians and the held/none ratio; writes bench/results/scheduled_claim.json.

    .venv/bin/python bench/scheduled_claim.py [--future 1000000] [--due 5000] [--batch 100] [--claims 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from bench._common import fresh_database, summary_ms, write_result
from celery_outbox.clock import SystemClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.relay.dispatch import dispatch_batch
from celery_outbox.relay.queries import due_pending
from celery_outbox.schema import Tables, define_tables
from celery_outbox.testing import InMemoryPublisher

DAY_MS = 86_400_000
ROUTES = {"BenchEvent": ("bench",)}


def insert_rows(engine: sa.Engine, tables: Tables, *, count: int, due_ms: int) -> float:
    """``count`` event rows due at ``due_ms``, written by one INSERT ... SELECT; returns seconds."""
    table = tables.table(tables.outbox).name
    started = time.perf_counter()
    with engine.begin() as c:
        c.exec_driver_sql(
            f"INSERT INTO {table} (message_id, type, payload, headers, created_at_ms, attempts, next_attempt_at_ms) "
            f"SELECT gen_random_uuid(), 'BenchEvent', jsonb_build_object('n', g), '{{}}'::jsonb, %(now)s, 0, %(due)s "
            f"FROM generate_series(1, %(count)s) AS g",
            {"now": SystemClock().now_ms(), "due": due_ms, "count": count})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.exec_driver_sql(f"VACUUM ANALYZE {table}")
    return time.perf_counter() - started


def explain(engine: sa.Engine, tables: Tables, batch: int) -> list[str]:
    stmt = due_pending(SystemClock().now_ms(), batch, tables=tables, skip_locked=True)
    sql = str(stmt.compile(engine, compile_kwargs={"literal_binds": True}))
    with engine.begin() as c:
        return [str(r[0]) for r in c.exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS) {sql}")]


def claim_times(sessions: sessionmaker[Session], tables: Tables, *, batch: int, claims: int) -> list[float]:
    samples = []
    with sessions() as s:
        for _ in range(claims):
            started = time.perf_counter()
            rows = s.execute(due_pending(SystemClock().now_ms(), batch, tables=tables, skip_locked=True)).all()
            samples.append(time.perf_counter() - started)
            s.rollback()
            assert len(rows) == batch, f"claimed {len(rows)} rows, expected {batch}"
    return samples


def batch_times(sessions: sessionmaker[Session], tables: Tables, *, batch: int) -> tuple[list[float], int]:
    publisher, clock, published = InMemoryPublisher(), SystemClock(), 0
    samples: list[float] = []
    while True:
        with sessions() as s:
            started = time.perf_counter()
            result = dispatch_batch(s, publisher, clock, tables=tables, batch_size=batch, max_attempts=10,
                                    base_delay_ms=1000, max_delay_ms=60_000, routes=ROUTES,
                                    max_message_bytes=256 * 1024, namespace="bench")
            elapsed = time.perf_counter() - started
        if result.claimed == 0:
            return samples, published
        samples.append(elapsed)
        published += result.published


def phase(url: str, *, future: int, due: int, batch: int, claims: int) -> dict[str, Any]:
    engine = make_engine(url)
    tables = define_tables(sa.MetaData())
    sessions = make_session_factory(engine)
    out: dict[str, Any] = {"future_rows": future, "due_rows": due}
    try:
        now = SystemClock().now_ms()
        if future:
            out["insert_future_s"] = round(insert_rows(engine, tables, count=future, due_ms=now + DAY_MS), 2)
        insert_rows(engine, tables, count=due, due_ms=now)
        out["explain"] = explain(engine, tables, batch)
        out["claim"] = summary_ms(claim_times(sessions, tables, batch=batch, claims=claims))
        samples, published = batch_times(sessions, tables, batch=batch)
        out["batch"] = summary_ms(samples)
        out["published"] = published
        with engine.connect() as c:
            left = c.exec_driver_sql(f"SELECT count(*) FROM {tables.table(tables.outbox).name} "
                                     "WHERE published_at_ms IS NULL").scalar_one()
        out["pending_after"] = int(left)
        assert published == due and left == future, f"published {published} of {due}, {left} left pending"
    finally:
        engine.dispose()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--future", type=int, default=1_000_000)
    p.add_argument("--due", type=int, default=5_000)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--claims", type=int, default=200)
    a = p.parse_args()
    results: dict[str, Any] = {"batch_size": a.batch}
    for name, future in (("none", 0), ("held", a.future)):
        with fresh_database("outbox_bench_sched") as url:
            results[name] = phase(url, future=future, due=a.due, batch=a.batch, claims=a.claims)
        r = results[name]
        print(f"{name:>5}: future={future:>9,} claim p50 {r['claim']['p50_ms']:.3f} ms p99 {r['claim']['p99_ms']:.3f} ms"
              f" | batch p50 {r['batch']['p50_ms']:.3f} ms p99 {r['batch']['p99_ms']:.3f} ms")
        print("       " + "\n       ".join(r["explain"]))
    results["ratio_claim_p50"] = round(results["held"]["claim"]["p50_ms"] / results["none"]["claim"]["p50_ms"], 3)
    results["ratio_batch_p50"] = round(results["held"]["batch"]["p50_ms"] / results["none"]["batch"]["p50_ms"], 3)
    results["ratio_batch_mean"] = round(statistics.fmean([results["held"]["batch"]["mean_ms"]])
                                        / results["none"]["batch"]["mean_ms"], 3)
    print(f"held/none: claim p50 x{results['ratio_claim_p50']}, batch p50 x{results['ratio_batch_p50']}, "
          f"batch mean x{results['ratio_batch_mean']}")
    write_result("scheduled_claim", results)


if __name__ == "__main__":
    main()
