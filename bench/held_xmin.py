"""A long-running transaction (held xmin) under steady load: what it does to the relay and the outbox.

On a Postgres database of its own: a writer thread inserts outbox rows at ``--rate`` rows/s (10 per
commit), a default ``RelayLoop`` drains them (an in-memory publisher: the database side only, no
broker noise), and a probe runs the relay's own claim query (``due_pending``, ``FOR UPDATE SKIP
LOCKED``, 100 rows, rolled back) every 0.25 s. Three phases of ``--phase-s`` seconds: before; during,
with another connection holding a transaction open (``BEGIN; SELECT txid_current()``, i.e. a held
``backend_xmin`` as a forgotten session or a long report would); after it commits. Every second:
relay rows/s, the claim's time, the outbox table's dead and live tuples (``pg_stat_user_tables``),
table and pending-index sizes, the age of the oldest ``backend_xmin``. Prints per phase and writes
bench/results/held_xmin[-<label>].json (with the timeline).

The outbox table carries the library's autovacuum settings (migration co0007, celery_outbox/autovacuum.py);
``--table-settings server`` resets them to the server's defaults, for the comparison. ``--admin-url`` picks
the server (e.g. a private one with autovacuum on: the shared test server has it off).

    .venv/bin/python bench/held_xmin.py [--rate 300] [--phase-s 120] [--hold-s <phase-s>]
        [--admin-url postgresql://postgres@127.0.0.1:5447/postgres] [--table-settings library|server]
        [--history 1000000] [--label x]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

from bench import _common
from bench._common import fresh_database, percentile, write_result
from celery_outbox import autovacuum
from celery_outbox.clock import SystemClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.relay.queries import due_pending
from celery_outbox.schema import define_tables
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=int, default=300, help="outbox rows written per second")
    ap.add_argument("--phase-s", type=float, default=120.0, help="seconds before and after the held transaction")
    ap.add_argument("--hold-s", type=float, default=0.0, help="seconds the transaction is held (default: --phase-s)")
    ap.add_argument("--admin-url", default=_common.PG_ADMIN_URL,
                    help="an admin URL of the Postgres server to create the scratch database on")
    ap.add_argument("--table-settings", choices=("library", "server"), default="library",
                    help="library: the hot tables' autovacuum settings of co0007; server: reset to the server's")
    ap.add_argument("--history", type=int, default=0,
                    help="published rows already retained before the run (retention keeps a day of them), then "
                         "VACUUM ANALYZE: the default trigger (20%% of the table) grows with them, co0007's does not")
    ap.add_argument("--label", default="", help="suffix of the result file (held_xmin-<label>.json)")
    args = ap.parse_args()
    hold_s = args.hold_s or args.phase_s
    clock = SystemClock()
    _common.PG_ADMIN_URL = args.admin_url  # fresh_database() reads it when called
    with fresh_database() as db_url:
        settings = Settings(database_url=db_url, broker_url="memory://", routes={"OrderPlaced": ("shipping",)})
        tables = define_tables(prefix=settings.table_prefix)
        engine = make_engine(db_url)
        plain = sa.create_engine(db_url)
        with plain.begin() as c:
            if args.table_settings == "server":
                autovacuum.reset(c, tables)
            if args.history:
                at = clock.now_ms() - 3_600_000
                c.execute(sa.text(
                    f"INSERT INTO {tables.table(tables.outbox).name} (message_id, type, payload, headers, created_at_ms, "
                    "published_at_ms, attempts, next_attempt_at_ms) SELECT gen_random_uuid(), 'OrderPlaced', "
                    "jsonb_build_object('n', i), '{}'::jsonb, :at, :at, 1, :at FROM generate_series(1, :n) AS i"),
                    {"at": at, "n": args.history})
        if args.history:
            with plain.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
                c.exec_driver_sql(f"VACUUM ANALYZE {tables.table(tables.outbox).name}")
        with plain.begin() as c:
            server = {k: c.exec_driver_sql(f"SHOW {k}").scalar() for k in
                      ("server_version", "autovacuum", "autovacuum_naptime", "autovacuum_vacuum_cost_delay")}
            reloptions = c.execute(sa.text("SELECT reloptions FROM pg_class WHERE relname = :t"),
                                   {"t": tables.table(tables.outbox).name}).scalar()
        print(f"server {server}; outbox reloptions {reloptions}", flush=True)
        sessions = make_session_factory(engine)
        outbox = tables.outbox
        table = tables.table(outbox).name
        index = f"ix_{settings.table_prefix}pending"
        due_index = f"ix_{settings.table_prefix}due"
        stop = threading.Event()
        published = [0]
        lock = threading.Lock()

        def writer() -> None:
            interval = 10 / args.rate
            nxt = time.monotonic()
            while not stop.is_set():
                now = clock.now_ms()
                with sessions() as s:
                    s.execute(sa.insert(outbox), [{"message_id": uuid.uuid4(), "type": "OrderPlaced",
                                                   "payload": {"n": i}, "headers": {}, "created_at_ms": now,
                                                   "next_attempt_at_ms": now, "attempts": 0} for i in range(10)])
                    s.commit()
                nxt += interval
                time.sleep(max(0.0, nxt - time.monotonic()))

        publisher = InMemoryPublisher()
        loop = RelayLoop(settings=settings, tables=tables, session_factory=sessions, publisher=publisher, listen=False)

        def relay() -> None:
            while not stop.is_set():
                r = loop.drain_once()
                with lock:
                    published[0] += r.published
                publisher.published.clear()  # the messages themselves are not the point here
                time.sleep(0.05)

        claims: list[tuple[float, float]] = []  # (monotonic, seconds)

        def probe() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                with engine.connect() as c:
                    c.execute(due_pending(clock.now_ms(), 100, tables=tables, skip_locked=True)).all()
                    c.rollback()
                claims.append((time.monotonic(), time.perf_counter() - t0))
                time.sleep(0.25)

        stats_sql = sa.text(
            "SELECT n_dead_tup, n_live_tup, pg_relation_size(relid), pg_relation_size(CAST(:ix AS regclass)), "
            "pg_relation_size(CAST(:due AS regclass)), "
            "(SELECT max(age(backend_xmin)) FROM pg_stat_activity WHERE backend_xmin IS NOT NULL), "
            "autovacuum_count, last_autovacuum FROM pg_stat_user_tables WHERE relname = :t")
        timeline: list[dict[str, Any]] = []
        threads = [threading.Thread(target=f, daemon=True) for f in (writer, relay, probe)]
        for t in threads:
            t.start()
        began = time.monotonic()
        holder: sa.Connection | None = None
        phases = [("before", args.phase_s), ("during", hold_s), ("after", args.phase_s)]
        bounds: dict[str, tuple[float, float]] = {}
        try:
            for phase, seconds in phases:
                if phase == "during":
                    # a foreign session (plain engine): the library's own connections end an idle
                    # transaction after OUTBOX_DB_IDLE_IN_TRANSACTION_TIMEOUT_MS (60 s), a report or a
                    # forgotten psql does not
                    holder = plain.connect()
                    holder.execute(sa.text("SELECT txid_current()"))  # a transaction with an xid: xmin held
                if phase == "after" and holder is not None:
                    holder.commit()
                    holder.close()
                    holder = None
                start = time.monotonic()
                last = published[0]
                while time.monotonic() - start < seconds:
                    time.sleep(1.0)
                    with engine.connect() as c:
                        dead, live, size, ix_size, due_size, xmin_age, av_count, _ = c.execute(
                            stats_sql, {"t": table, "ix": index, "due": due_index}).one()
                    with lock:
                        now_pub = published[0]
                    recent = [d for t, d in claims if t >= time.monotonic() - 1.0]
                    timeline.append({"t_s": round(time.monotonic() - began, 1), "phase": phase,
                                     "relay_rows_per_s": now_pub - last, "claim_ms": round(1000 * max(recent), 2)
                                     if recent else None, "dead_tuples": int(dead or 0), "live_tuples": int(live or 0),
                                     "table_bytes": int(size), "pending_index_bytes": int(ix_size),
                                     "due_index_bytes": int(due_size),
                                     "oldest_xmin_age": int(xmin_age or 0), "autovacuums": int(av_count or 0)})
                    last = now_pub
                bounds[phase] = (start, time.monotonic())
        finally:
            stop.set()
            if holder is not None:
                holder.rollback()
                holder.close()
            for t in threads:
                t.join(timeout=10)
            loop.close()
            engine.dispose()
            plain.dispose()
    summary: dict[str, Any] = {}
    for phase, (t0, t1) in bounds.items():
        rows = [p for p in timeline if p["phase"] == phase]
        durations = [1000 * d for t, d in claims if t0 <= t < t1]
        summary[phase] = {
            "relay_rows_per_s": round(statistics.fmean(p["relay_rows_per_s"] for p in rows), 1),
            "claim_p50_ms": round(percentile(durations, 50), 2), "claim_p99_ms": round(percentile(durations, 99), 2),
            "dead_tuples_end": rows[-1]["dead_tuples"], "dead_tuples_max": max(p["dead_tuples"] for p in rows),
            "table_bytes_end": rows[-1]["table_bytes"], "pending_index_bytes_end": rows[-1]["pending_index_bytes"],
            "pending_index_bytes_max": max(p["pending_index_bytes"] for p in rows),
            "due_index_bytes_end": rows[-1]["due_index_bytes"],
            "due_index_bytes_max": max(p["due_index_bytes"] for p in rows),
            "autovacuums": rows[-1]["autovacuums"] - (rows[0]["autovacuums"] if phase != "before" else 0),
            "oldest_xmin_age_max": max(p["oldest_xmin_age"] for p in rows),
        }
        print(f"{phase:>6}: {summary[phase]}", flush=True)
    before = summary["before"]
    after_rows = [p for p in timeline if p["phase"] == "after"]
    base = max(before["dead_tuples_max"], 1)
    recovered = next((p["t_s"] - after_rows[0]["t_s"] for p in after_rows if p["dead_tuples"] <= 2 * base), None)
    summary["dead_tuples_back_within_2x_before_after_s"] = recovered
    summary["during_over_before"] = {
        "relay_rows_per_s": round(summary["during"]["relay_rows_per_s"] / max(before["relay_rows_per_s"], 1e-9), 3),
        "claim_p99": round(summary["during"]["claim_p99_ms"] / max(before["claim_p99_ms"], 1e-9), 2),
        "dead_tuples_max": round(summary["during"]["dead_tuples_max"] / base, 1),
    }
    print(f"during / before: {summary['during_over_before']}; dead tuples back within 2x of before "
          f"{recovered} s after the transaction ended", flush=True)
    write_result("held_xmin" + (f"-{args.label}" if args.label else ""), {
        "rate": args.rate, "phase_s": args.phase_s, "hold_s": hold_s, "table_settings": args.table_settings,
        "history": args.history,
        "server": server, "outbox_reloptions": reloptions, "summary": summary, "timeline": timeline})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
