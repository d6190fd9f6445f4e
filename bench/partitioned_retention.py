"""Retention on the plain outbox table (batched DELETE) vs the partitioned layout (DROP of a partition),
same run, same rows: docs/partitioning.md.

Two databases side by side, each loaded with ``--rows`` published rows (one ``INSERT ... SELECT
generate_series``; ``published_at_ms`` grows with seq, so a cutoff takes the oldest rows): ``plain`` (the
default table) and ``partitioned`` (converted while empty, ``--size`` rows per partition, then loaded).
Then ``--rounds`` rounds, layouts interleaved; each round moves the retention cutoff one partition
(``--size`` rows) further and, per layout:

- relay alone: a fresh default ``RelayLoop`` (in-memory publisher) drains ``--drain-rows`` new rows;
- relay during retention: ``ops.retention.prune`` (its own process) removes the next ``--size`` oldest
  rows while the relay drains ``--drain-rows`` more; the prune's wall time, the relay's rate and its
  slowest batch (a lock the drop takes shows there) are recorded.

Also: the write cost of the new rows (the partitioned layout's reused-id trigger), the table's size
after the rounds, ``convert`` of the plain database at the end (its CHECK validation scan and the
exclusive lock's duration, at the rows it then holds), and, unless ``--skip-revert``, ``revert`` of the
partitioned one (a copy under the lock). Prints every figure and writes
bench/results/partitioned_retention.json.

    flock /tmp/bench.lock .venv/bin/python bench/partitioned_retention.py [--rows 10000000] [--size 1000000]
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

from bench._common import fresh_database, write_result
from bench.scale import PAYLOAD
from celery_outbox.clock import ManualClock, SystemClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.ops import partitions, retention
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.schema import Tables, define_tables
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings

NOW_MS = 10**13  # the retention clock: every loaded row was published at its index (ms), long before this


def load(engine: sa.Engine, n: int, *, start: int, published: bool, tables: Tables, tag: str) -> float:
    """``n`` rows in one ``INSERT ... SELECT generate_series``; published ones at ``published_at_ms = index``.
    Returns the INSERT's seconds."""
    table = tables.table(tables.outbox).name
    published_sql = "g" if published else "NULL"
    t = time.perf_counter()
    with engine.begin() as c:
        c.exec_driver_sql("SET LOCAL statement_timeout = 0")
        c.exec_driver_sql(
            f"INSERT INTO {table} (message_id, type, payload, headers, created_at_ms, published_at_ms, attempts, "
            f"next_attempt_at_ms) SELECT md5(g::text || '{tag}')::uuid, 'OrderPlaced', '{PAYLOAD}'::jsonb, "
            f"'{{}}'::jsonb, g, {published_sql}, 0, 0 FROM generate_series({start}, {start + n - 1}) AS g")
    took = time.perf_counter() - t
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.exec_driver_sql("SET statement_timeout = 0")
        c.exec_driver_sql(f"VACUUM ANALYZE {table}")
    return took


def drain(engine: sa.Engine, rows: int, *, settings: Settings, tables: Tables, tag: str) -> dict[str, float]:
    """Write ``rows`` pending rows (timed), then drain them with a fresh default RelayLoop (timed per batch)."""
    table = tables.table(tables.outbox).name
    t = time.perf_counter()
    with engine.begin() as c:
        c.exec_driver_sql(
            f"INSERT INTO {table} (message_id, type, payload, headers, created_at_ms, attempts, next_attempt_at_ms) "
            f"SELECT md5(g::text || '{tag}')::uuid, 'OrderPlaced', '{PAYLOAD}'::jsonb, '{{}}'::jsonb, g, 0, 0 "
            f"FROM generate_series(1, {rows}) AS g")
    insert_s = time.perf_counter() - t
    loop = RelayLoop(settings=settings, tables=tables, session_factory=make_session_factory(engine),
                     publisher=InMemoryPublisher(), listen=False)
    published = 0
    slowest = 0.0
    t = time.perf_counter()
    while published < rows:
        b = time.perf_counter()
        published += loop.drain_once().published
        slowest = max(slowest, time.perf_counter() - b)
    elapsed = time.perf_counter() - t
    loop.close()
    assert published == rows, (published, rows)
    return {"rows_per_s": rows / elapsed, "slowest_batch_ms": slowest * 1000, "insert_rows_per_s": rows / insert_s}


def single_writes(engine: sa.Engine, n: int, *, tables: Tables, tag: str) -> float:
    """``n`` one-row INSERTs, each its own transaction (an application's write path); returns rows/s.
    The rows are published at once (published_at_ms = 0) so the relay never sees them."""
    table = tables.table(tables.outbox).name
    sql = sa.text(f"INSERT INTO {table} (message_id, type, payload, headers, created_at_ms, published_at_ms, attempts, "
                  f"next_attempt_at_ms) VALUES (md5(:k)::uuid, 'OrderPlaced', '{PAYLOAD}'::jsonb, '{{}}'::jsonb, 0, 0, "
                  "0, 0)")
    t = time.perf_counter()
    for i in range(n):
        with engine.begin() as c:
            c.execute(sql, {"k": f"{tag}{i}"})
    return n / (time.perf_counter() - t)


def retain(url: str, prefix: str, cutoff: int, out: Any) -> None:
    """In its own process: one ``retention.prune`` of published rows older than ``cutoff`` (ms); records
    (seconds, rows removed, partitions dropped)."""
    tables = define_tables(prefix=prefix)
    engine = make_engine(url)
    t = time.perf_counter()
    report = retention.prune(make_session_factory(engine), tables=tables, inbox_older_than_ms=None,
                             published_older_than_ms=NOW_MS - cutoff, clock=ManualClock(start_ms=NOW_MS),
                             redelivery_window_ms=1)
    out[0] = time.perf_counter() - t
    out[1] = report.outbox_deleted
    out[2] = report.outbox_partitions_dropped or 0
    engine.dispose()


def table_bytes(engine: sa.Engine, tables: Tables) -> int:
    """The outbox table with its indexes (every partition's, on the partitioned layout)."""
    table = tables.table(tables.outbox).name
    with engine.connect() as c:
        return int(c.exec_driver_sql(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c WHERE c.oid = %(t)s::regclass "
            "OR c.oid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = %(t)s::regclass)", {"t": table}).scalar_one())


def wal_lsn(engine: sa.Engine) -> str:
    with engine.connect() as c:
        return str(c.exec_driver_sql("SELECT pg_current_wal_lsn()").scalar())


def wal_bytes(engine: sa.Engine, since: str) -> int:
    with engine.connect() as c:
        return int(c.exec_driver_sql("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %(s)s::pg_lsn)",
                                     {"s": since}).scalar_one())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--size", type=int, default=1_000_000, help="rows per partition, and per retention round")
    parser.add_argument("--drain-rows", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--single-writes", type=int, default=1000, help="one-row transactions timed per round")
    parser.add_argument("--skip-revert", action="store_true")
    args = parser.parse_args()
    settings = Settings()
    tables = define_tables(prefix=settings.table_prefix)
    ctx = multiprocessing.get_context("spawn")
    out: dict[str, Any] = {"rows": args.rows, "size": args.size, "drain_rows": args.drain_rows, "rounds": args.rounds}
    started = time.perf_counter()
    with fresh_database() as plain_url, fresh_database() as part_url:
        urls = {"plain": plain_url, "partitioned": part_url}
        engines = {name: make_engine(url) for name, url in urls.items()}
        sessions = {name: make_session_factory(e) for name, e in engines.items()}
        ahead = args.rows // args.size + 2
        partitions.convert(sessions["partitioned"], tables=tables, size=args.size, ahead=ahead)
        unique = f"{tables.prefix}message_id_unique"
        table = tables.table(tables.outbox).name
        loads = {}
        for name, engine in engines.items():
            if name == "partitioned":  # setup only: the reused-id check per row is measured on the drained rows
                with engine.begin() as c:
                    c.exec_driver_sql(f"ALTER TABLE {table} DISABLE TRIGGER {unique}")
            loads[name] = load(engine, args.rows, start=1, published=True, tables=tables, tag="history")
            if name == "partitioned":
                with engine.begin() as c:
                    c.exec_driver_sql(f"ALTER TABLE {table} ENABLE TRIGGER {unique}")
            print(f"{name}: loaded {args.rows:,} published rows in {loads[name]:.1f}s", flush=True)
        with sessions["partitioned"]() as s:
            out["partitions_loaded"] = len(partitions.list_partitions(s, tables=tables))
        out["load_s"] = {k: round(v, 1) for k, v in loads.items()}
        out["bytes_before"] = {name: table_bytes(e, tables) for name, e in engines.items()}
        runs: dict[str, dict[str, list[float]]] = {
            name: {"alone": [], "during": [], "retain_s": [], "retained_rows": [], "slowest_alone_ms": [],
                   "slowest_during_ms": [], "insert_rows_per_s": [], "single_writes_per_s": [], "wal_bytes": []}
            for name in urls}
        for r in range(1, args.rounds + 1):
            cutoff = r * args.size + 1  # rows published at index <= r * size are past retention
            for name, engine in engines.items():
                runs[name]["single_writes_per_s"].append(
                    single_writes(engine, args.single_writes, tables=tables, tag=f"s{r}"))
                alone = drain(engine, args.drain_rows, settings=settings, tables=tables, tag=f"a{r}")
                result = ctx.Array("d", 3)
                lsn = wal_lsn(engine)
                pruner = ctx.Process(target=retain, args=(urls[name], tables.prefix, cutoff, result))
                pruner.start()
                during = drain(engine, args.drain_rows, settings=settings, tables=tables, tag=f"d{r}")
                pruner.join(timeout=1800)
                wal = wal_bytes(engine, lsn)
                row = runs[name]
                row["alone"].append(alone["rows_per_s"])
                row["during"].append(during["rows_per_s"])
                row["slowest_alone_ms"].append(alone["slowest_batch_ms"])
                row["slowest_during_ms"].append(during["slowest_batch_ms"])
                row["insert_rows_per_s"] += [alone["insert_rows_per_s"], during["insert_rows_per_s"]]
                row["retain_s"].append(result[0])
                row["retained_rows"].append(result[1])
                row["wal_bytes"].append(wal)
                print(f"round {r} {name:11s}: retention removed {int(result[1]):,} rows "
                      f"({int(result[2])} partition(s)) in {result[0]:.2f}s, WAL {wal / 1e6:.0f} MB (server-wide); "
                      f"relay alone {alone['rows_per_s']:,.0f} rows/s, during {during['rows_per_s']:,.0f} rows/s, "
                      f"slowest batch {alone['slowest_batch_ms']:.0f} / {during['slowest_batch_ms']:.0f} ms", flush=True)
        summary: dict[str, Any] = {}
        for name, row in runs.items():
            a, d = statistics.median(row["alone"]), statistics.median(row["during"])
            summary[name] = {
                "relay_alone_rows_per_s": round(a), "relay_during_retention_rows_per_s": round(d),
                "during_over_alone": round(d / a, 4), "retention_s_per_round": round(statistics.median(row["retain_s"]), 3),
                "retained_rows_per_round": int(statistics.median(row["retained_rows"])),
                "wal_mb_per_round": round(statistics.median(row["wal_bytes"]) / 1e6, 1),
                "slowest_batch_ms_alone": round(max(row["slowest_alone_ms"]), 1),
                "slowest_batch_ms_during": round(max(row["slowest_during_ms"]), 1),
                "insert_rows_per_s": round(statistics.median(row["insert_rows_per_s"])),
                "single_writes_per_s": round(statistics.median(row["single_writes_per_s"])),
                "runs": {k: [round(x, 3) for x in v] for k, v in row.items()},
            }
        out["layouts"] = summary
        p, q = summary["plain"], summary["partitioned"]
        out["ratios"] = {
            "retention_time_partitioned_over_plain": round(q["retention_s_per_round"] / p["retention_s_per_round"], 5),
            "relay_during_retention_partitioned_over_plain": round(
                q["relay_during_retention_rows_per_s"] / p["relay_during_retention_rows_per_s"], 4),
            "relay_alone_partitioned_over_plain": round(q["relay_alone_rows_per_s"] / p["relay_alone_rows_per_s"], 4),
            "bulk_insert_partitioned_over_plain": round(q["insert_rows_per_s"] / p["insert_rows_per_s"], 4),
            "single_writes_partitioned_over_plain": round(q["single_writes_per_s"] / p["single_writes_per_s"], 4),
        }
        out["bytes_after"] = {name: table_bytes(e, tables) for name, e in engines.items()}
        for name in urls:
            s = summary[name]
            print(f"{name:11s}: retention {s['retention_s_per_round']:.3f}s per {args.size:,} rows; relay alone "
                  f"{s['relay_alone_rows_per_s']:,} rows/s, during retention {s['relay_during_retention_rows_per_s']:,}"
                  f" rows/s ({s['during_over_alone']:.3f}x); slowest batch during {s['slowest_batch_ms_during']} ms; "
                  f"bulk insert {s['insert_rows_per_s']:,} rows/s, one-row transactions {s['single_writes_per_s']:,}/s; "
              f"table+indexes {out['bytes_before'][name] / 1e9:.2f} -> "
                  f"{out['bytes_after'][name] / 1e9:.2f} GB")
        print(f"ratios (partitioned / plain): {out['ratios']}", flush=True)
        # -- the migration path, at the rows the databases now hold ------------------------------------------
        with engines["plain"].connect() as c:
            held = int(c.execute(sa.select(sa.func.count()).select_from(tables.outbox)).scalar_one())
        conv = partitions.convert(sessions["plain"], tables=tables, size=args.size, ahead=2)
        out["convert"] = {"rows": held, **conv.to_dict()}
        print(f"convert of the plain table holding {held:,} rows: CHECK validation scan {conv.validate_s:.2f}s "
              f"(writes go on), ACCESS EXCLUSIVE held {conv.lock_s * 1000:.0f} ms", flush=True)
        if not args.skip_revert:
            # "prune first" (docs/partitioning.md): drop all but the newest loaded partition, then copy the rest
            keep_from = args.rows - args.size + 1
            retention.prune(sessions["partitioned"], tables=tables, inbox_older_than_ms=None,
                            published_older_than_ms=NOW_MS - keep_from, clock=ManualClock(start_ms=NOW_MS),
                            redelivery_window_ms=1)
            with engines["partitioned"].connect() as c:
                held = int(c.execute(sa.select(sa.func.count()).select_from(tables.outbox)).scalar_one())
            lock_s = partitions.revert(sessions["partitioned"], tables=tables)
            out["revert"] = {"rows": held, "lock_s": round(lock_s, 3)}
            print(f"revert of the partitioned table holding {held:,} rows: ACCESS EXCLUSIVE held {lock_s:.1f}s "
                  "(the copy)", flush=True)
        for e in engines.values():
            e.dispose()
    out["wall_s"] = round(time.perf_counter() - started, 1)
    out["clock_note"] = f"retention clock fixed at {NOW_MS}; wall clock {SystemClock().now_ms()}"
    write_result("partitioned_retention", out)


if __name__ == "__main__":
    main()
