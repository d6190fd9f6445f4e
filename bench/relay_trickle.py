"""The relay's cost per wake-up and per row under a steady trickle of small commits (issue #24).

A ``RelayLoop`` runs as ``outbox relay`` runs it (``run``: LISTEN/NOTIFY, DEFAULT settings, the
reconciler and retention under their leases, the deploy hold on) in a thread of this process, on RabbitMQ;
a writer thread commits 1-10 outbox rows per commit (seeded random; ``OrderPlaced`` events and
confirmation e-mail tasks, alternating) at ``--rate`` commits/s for ``--seconds``, then waits until
the outbox is drained. Read on the relay's own engine (SQLAlchemy events): statements by kind
(claim, mark, next due, registry, savepoint, lease, reconcile, other), transactions begun, commits,
rollbacks, pool checkouts and pre-pings (``db.pre_ping_after_idle``); from ``/proc``: the CPU of the
loop's thread and of the relay's Postgres backends (LISTEN included). Wake-ups are the loop's drains.

Each tree runs in a child process (its source first on PYTHONPATH): ``--baseline-src DIR`` (e.g.
``git archive <rev> | tar -x -C DIR``) and this tree, interleaved over ``--rounds`` (base, this, this,
base, ...). Prints medians per tree and writes bench/results/<name>.json.

    .venv/bin/python bench/relay_trickle.py [--rate 20] [--seconds 10] [--rounds 2] [--baseline-src DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
KINDS = ("claim", "mark", "next_due", "registry", "savepoint", "lease", "reconcile", "other")


def cpu_s(path: str) -> float:
    """User + system CPU seconds of a /proc stat file (0 when it is gone)."""
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def kind_of(sql: str) -> str:
    s = " ".join(sql.split()).lower()
    if s.startswith("with marked as"):
        return "mark"
    if s.startswith("with slot as"):
        return "counter"
    if "for update skip locked" in s:
        return "claim"
    if s.startswith("select min(") and "next_attempt_at_ms" in s:
        return "next_due"
    if "outbox_workers" in s or "workers" in s.split(" from ", 1)[-1][:40]:
        return "registry"
    if "savepoint" in s:
        return "savepoint"
    if "lease:" in s or ("counters" in s and "_relay" in s) or s.startswith(("insert into outbox_counters",
                                                                            "update outbox_counters")):
        return "lease"
    if "inbox" in s or "receipts" in s:
        return "reconcile"
    return "other"


def measure(rate: float, seconds: float, seed: int, broker_url: str, profile: str = "") -> dict[str, Any]:
    """One run of the relay code importable here (the child's PYTHONPATH: its tree first)."""
    from kombu import Connection, Queue
    from sqlalchemy import event

    from bench._common import fresh_database
    from celery_outbox import Event
    from celery_outbox.celery.kombu_publisher import KombuPublisher
    from celery_outbox.db import make_engine, make_session_factory
    from celery_outbox.relay.loop import RelayLoop
    from celeryconfig import Settings
    from orders.service import ORDER_PLACED
    from orders.tasks import confirmation_email_task
    from relay.factory import create_outbox

    with fresh_database() as url:
        settings = Settings.from_env({"OUTBOX_DATABASE_URL": url, "OUTBOX_BROKER_URL": broker_url,
                                      "OUTBOX_NAMESPACE": f"trickle{uuid.uuid4().hex[:6]}"})
        writer = make_engine(url, settings=settings)
        writes = make_session_factory(writer)
        outbox = create_outbox(settings, session_factory=writes)
        table = outbox.tables.table(outbox.tables.outbox)
        engine = make_engine(url, settings=settings)  # the relay's own: only its work is counted
        n: dict[str, int] = {"statements": 0, "begins": 0, "commits": 0, "rollbacks": 0, "checkouts": 0,
                             "pre_pings": 0, **{f"sql_{k}": 0 for k in KINDS}}
        backends: list[int] = []

        def bump(key: str) -> Any:
            def on(*_: Any) -> None:
                n[key] += 1
            return on

        def on_sql(_conn: Any, _cur: Any, statement: str, *_: Any) -> None:
            n["statements"] += 1
            n[f"sql_{kind_of(statement)}"] += 1

        event.listen(engine, "before_cursor_execute", on_sql)
        event.listen(engine, "begin", bump("begins"))
        event.listen(engine, "commit", bump("commits"))
        event.listen(engine, "rollback", bump("rollbacks"))
        event.listen(engine.pool, "checkout", bump("checkouts"))
        event.listen(engine.pool, "connect", lambda dbapi, _rec: backends.append(dbapi.get_backend_pid()))
        ping = engine.dialect.do_ping

        def counted_ping(dbapi_conn: Any) -> bool:
            n["pre_pings"] += 1
            return bool(ping(dbapi_conn))

        engine.dialect.do_ping = counted_ping  # type: ignore[method-assign,assignment]
        routes = outbox.routes()
        consumers = tuple(dict.fromkeys(c for names in routes.values() for c in names))
        publisher = KombuPublisher(broker_url=broker_url, settings=settings, consumers=consumers)
        loop = RelayLoop(settings=settings, tables=outbox.tables, session_factory=make_session_factory(engine),
                         publisher=publisher, routes=routes, idempotent_tasks=outbox.idempotent_tasks())
        email = confirmation_email_task(outbox)
        rng = random.Random(seed)
        written = [0]

        def commit(i: int) -> None:
            k = rng.randint(1, 10)
            with writes() as s, outbox.transaction(s):
                for j in range(k):
                    if j % 2 == 0:
                        outbox.publish(s, Event(ORDER_PLACED, {"order_id": f"t{i}-{j}", "total_cents": 100}))
                    else:
                        email.delay(f"t{i}-{j}")
                s.commit()
            written[0] += k

        def pending() -> int:
            import sqlalchemy as sa

            with writes() as s:
                return int(s.execute(sa.select(sa.func.count()).select_from(table)
                                     .where(table.c.published_at_ms.is_(None))).scalar_one())

        profiler = cProfile.Profile() if profile else None

        def run() -> None:
            if profiler is None:
                loop.run(handle_signals=False)
            else:
                profiler.runcall(loop.run, handle_signals=False)

        runner = threading.Thread(target=run, name="relay", daemon=True)
        runner.start()
        for i in range(20):  # warm-up: connections, declarations, statement caches, the first reconcile pass
            commit(-1 - i)
            time.sleep(0.05)
        while pending():
            time.sleep(0.05)
        time.sleep(0.3)
        if profiler is not None:  # only the measured part (the thread's profile restarts cleanly)
            profiler.clear()
        tid = runner.native_id
        n = dict.fromkeys(n, 0)
        written[0] = 0
        drains0, stats0 = loop.stats.drains, dict(vars(loop.stats))
        cpu0 = cpu_s(f"/proc/self/task/{tid}/stat")
        pg0 = {pid: cpu_s(f"/proc/{pid}/stat") for pid in backends}
        period, start = 1.0 / rate, time.perf_counter()
        commits = round(rate * seconds)
        for i in range(commits):
            delay = start + i * period - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            commit(i)
        while pending():
            time.sleep(0.02)
        time.sleep(0.3)  # the last wake-up's wait begins
        cpu1 = cpu_s(f"/proc/self/task/{tid}/stat")
        pg = sum(cpu_s(f"/proc/{pid}/stat") - pg0.get(pid, 0.0) for pid in backends)
        counts, rows = dict(n), written[0]
        wakeups = loop.stats.drains - drains0
        stats = {k: v - stats0[k] for k, v in vars(loop.stats).items() if isinstance(v, int) and not isinstance(v, bool)}
        loop.stop()
        runner.join(10)
        if profiler is not None:
            profiler.dump_stats(profile)
        publisher.close()
        loop.close()
        with Connection(broker_url) as conn:
            ch = conn.channel()
            for name in settings.worker_queues:
                try:
                    Queue(name, no_declare=True)(ch).delete()
                except Exception:  # a queue nobody declared
                    ch = conn.channel()
        engine.dispose()
        writer.dispose()
    out: dict[str, Any] = {"commits": commits, "rows": rows, "wakeups": wakeups,
                           "rows_per_wakeup": rows / max(1, wakeups),
                           "relay_cpu_ms_per_row": 1000 * (cpu1 - cpu0) / rows,
                           "pg_cpu_ms_per_row": 1000 * pg / rows,
                           "relay_cpu_ms_per_wakeup": 1000 * (cpu1 - cpu0) / max(1, wakeups),
                           "loop_stats": stats}
    for k, v in counts.items():
        out[f"{k}_per_wakeup"] = v / max(1, wakeups)
    out["round_trips_per_wakeup"] = sum(counts[k] for k in ("statements", "begins", "commits", "rollbacks",
                                                             "pre_pings")) / max(1, wakeups)
    return out


SHOWN = ("rows_per_wakeup", "round_trips_per_wakeup", "statements_per_wakeup", "begins_per_wakeup",
         "commits_per_wakeup", "rollbacks_per_wakeup", "pre_pings_per_wakeup", "checkouts_per_wakeup",
         *(f"sql_{k}_per_wakeup" for k in KINDS), "relay_cpu_ms_per_wakeup", "relay_cpu_ms_per_row",
         "pg_cpu_ms_per_row")


def profile(args: argparse.Namespace) -> None:
    """One profiled run of this tree: where the loop thread's time goes, per wake-up (profiler overhead included)."""
    import pstats

    out = REPO / "bench" / "results" / f"{args.name}.prof"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, __file__, "--child", "--rate", str(args.rate), "--seconds", str(args.seconds),
                           "--seed", str(args.seed), "--broker-url", args.broker_url, "--profile-to", str(out)],
                          env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    wakeups = max(1, got["wakeups"])
    stats = pstats.Stats(str(out))
    print(f"{got['wakeups']} wake-ups, {got['rows']} rows; cumulative ms per wake-up (wall, profiled):")
    rows = [(ct, f, ln, fn) for (f, ln, fn), (_cc, _nc, _tt, ct, _callers) in stats.stats.items()  # type: ignore[attr-defined]
            if "celery_outbox" in f]
    for ct, f, ln, fn in sorted(rows, reverse=True)[:30]:
        print(f"  {1000 * ct / wakeups:8.3f}  {f.split('celery_outbox/')[-1]}:{ln} {fn}")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", type=float, default=20.0, help="commits/s")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=24)
    parser.add_argument("--broker-url", default="amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--baseline-src", default="", help="a source tree run as 'base'")
    parser.add_argument("--name", default="relay_trickle", help="bench/results/<name>.json")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the loop's thread (this tree only, one round): bench/results/<name>.prof")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-to", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path[:0] = [p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p]
        print(json.dumps(measure(args.rate, args.seconds, args.seed, args.broker_url, args.profile_to)))
        return
    if args.profile:
        profile(args)
        return
    trees = {**({"base": args.baseline_src} if args.baseline_src else {}), "this": str(REPO)}
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
    for rnd in range(args.rounds):
        for name in (list(trees) if rnd % 2 == 0 else list(trees)[::-1]):
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([trees[name], str(REPO)])}
            proc = subprocess.run([sys.executable, __file__, "--child", "--rate", str(args.rate), "--seconds",
                                   str(args.seconds), "--seed", str(args.seed + rnd), "--broker-url", args.broker_url],
                                  env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[name].append(got)
            print(f"round {rnd} {name:5s}: {got['wakeups']} wake-ups, {got['rows']} rows, "
                  f"{got['round_trips_per_wakeup']:.2f} round trips/wake-up, "
                  f"relay {got['relay_cpu_ms_per_row']:.3f} + pg {got['pg_cpu_ms_per_row']:.3f} ms CPU/row", flush=True)
    med = {t: {k: statistics.median(r[k] for r in rs) for k in SHOWN} for t, rs in runs.items()}
    print(f"\nmedians over {args.rounds} round(s), {args.rate:g} commits/s of 1-10 rows for {args.seconds:g} s:")
    print(f"  {'':28s}" + "".join(f"{t:>10s}" for t in trees))
    for k in SHOWN:
        print(f"  {k:28s}" + "".join(f"{med[t][k]:10.3f}" for t in trees))
    sys.path.insert(0, str(REPO))
    from bench._common import write_result

    write_result(args.name, {"rate": args.rate, "seconds": args.seconds, "rounds": args.rounds, "trees": trees,
                             "medians": med, "runs": runs})


if __name__ == "__main__":
    main()
