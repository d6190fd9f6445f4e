"""The relay's cost per order at moderate rates, where it wakes once per commit (issue #24).

A real ``outbox relay`` process (LISTEN/NOTIFY, DEFAULT settings but the reconcile interval, see below)
on RabbitMQ; this script commits orders through the reference Orders service (``place_order``: the order,
its ``OrderPlaced`` event and the confirmation e-mail task's row in one commit, like the HTTP endpoint)
at each offered rate for ``--seconds``, waits until the outbox is drained, and reads:

- the relay process's CPU (``/proc/<pid>/stat``, user + system) per order;
- the CPU of the relay's Postgres backends (every client backend of the run's database but this
  script's own, which are named ``relay-wakeups-bench``) per order;
- the CPU of the RabbitMQ server (the process listening on the broker's port, read from ``/proc``; a
  shared server also serves whatever else runs meanwhile: run it alone) per order. The relay talks to
  RabbitMQ directly, not through the chaos environment's proxy (which would add its latency to every
  confirm);
- orders per batch (a batch stamps its rows with one ``published_at_ms``: distinct stamps);
- commit -> published latency per row (``published_at_ms - created_at_ms``: the relay stamps the row
  after the broker confirmed it, or, since issue #38, a drain's first batch at its claim, committed after
  the confirm: a few ms earlier, so compare this figure only between trees that stamp alike), p50 / p99.

Variants run interleaved in every round (a fresh relay process each): ``--gather-ms`` values of this
tree's relay (``OUTBOX_RELAY_GATHER_MS``) and, with ``--baseline-src DIR``, the relay of another source
tree (e.g. ``git archive main | tar -x -C DIR``) put first on the relay's PYTHONPATH (``--variant-src
NAME=DIR``, repeatable, adds more such trees) and, with ``--drivers psycopg2,psycopg``, this tree's relay on each
Postgres driver (its ``OUTBOX_DATABASE_URL`` names it; this script's own writers keep the default driver and are
not counted). No worker runs:
the broker keeps the messages (queues purged between steps); the reconcile interval is set to a day so
the reconciler (which would re-send what no consumer recorded) stays out of the figures. Prints
medians over rounds and the ratios against the first variant; writes bench/results/<name>.json.

    .venv/bin/python bench/relay_wakeups.py [--rates 40,80,160] [--seconds 8] [--rounds 2]
        [--gather-ms 0,5,10] [--baseline-src /tmp/base] [--variant-src name=/tmp/other] [--drivers psycopg2,psycopg]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa
from kombu import Connection, Queue

from bench._common import DRIVERS, driver_url, percentile, write_result
from bench.e2e_latency import default_env
from celery_outbox.db import make_engine, make_session_factory
from chaos.environment import ChaosEnvironment
from chaos.load import order_body
from chaos.processes import ManagedProcess, relay_argv
from orders.service import parse_order, place_order

REPO = Path(__file__).resolve().parent.parent
APP_NAME = "relay-wakeups-bench"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def broker_pid(url: str) -> int:
    """The pid of the process listening on the broker URL's port (0 when it cannot be found)."""
    port = int(url.split("@", 1)[-1].split("/", 1)[0].rpartition(":")[2] or 5672)
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # LISTEN on the port
                    inodes.add(f[9])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(proc.name)
    return 0


def backends_cpu_s(engine: sa.Engine, db_name: str) -> dict[int, float]:
    """CPU seconds of every client backend of ``db_name`` but this script's own."""
    with engine.connect() as c:
        pids = c.execute(sa.text(
            "SELECT pid FROM pg_stat_activity WHERE datname = :db AND backend_type = 'client backend' "
            "AND application_name <> :me AND pid <> pg_backend_pid()"), {"db": db_name, "me": APP_NAME}).scalars().all()
    return {pid: cpu_s(pid) for pid in pids}


def offer(write: Any, *, tag: str, rate: float, seconds: float, clients: int) -> int:
    """Commit ``rate * seconds`` orders at ``rate``/s from ``clients`` threads (open loop); returns how many."""
    total = round(rate * seconds)
    period = 1.0 / rate
    start = time.perf_counter() + 0.05
    done = [0] * clients

    def client(k: int) -> None:
        for i in range(k, total, clients):
            delay = start + i * period - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            write(f"{tag}-{i}", i)
            done[k] += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", default="40,80,160", help="offered orders/s")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each offer")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4, help="writer threads")
    parser.add_argument("--gather-ms", default="0", help="OUTBOX_RELAY_GATHER_MS values of this tree's relay")
    parser.add_argument("--baseline-src", default="", help="a source tree whose relay runs as the variant 'base'")
    parser.add_argument("--variant-src", action="append", default=[], help="NAME=DIR: another source tree's relay")
    parser.add_argument("--drivers", default="", help=f"comma separated, of {', '.join(DRIVERS)}: the relay on each")
    parser.add_argument("--name", default="relay_wakeups", help="bench/results/<name>.json")
    args = parser.parse_args()
    drivers = [d for d in args.drivers.split(",") if d]
    if any(d not in DRIVERS for d in drivers):
        parser.exit(2, f"--drivers: of {', '.join(DRIVERS)}\n")
    rates = [float(r) for r in args.rates.split(",")]
    variants: dict[str, dict[str, str]] = {}
    if args.baseline_src:
        variants["base"] = {"PYTHONPATH": os.pathsep.join([args.baseline_src, str(REPO)])}
    for spec in args.variant_src:
        vname, _, src = spec.partition("=")
        variants[vname] = {"PYTHONPATH": os.pathsep.join([src, str(REPO)])}
    work = Path(tempfile.mkdtemp(prefix="outbox-wakeups-"))
    extra = {**default_env(), "OUTBOX_RELAY_RECONCILE_INTERVAL_S": "86400"}
    env = ChaosEnvironment(broker="rabbitmq", workdir=work, extra_env=extra)
    gathers = [str(int(g)) for g in args.gather_ms.split(",") if g]
    for g in gathers:
        for d in drivers or [None]:
            variants[f"gather{g}" + (f"-{d}" if d else "")] = {
                "OUTBOX_RELAY_GATHER_MS": g,
                **({"OUTBOX_DATABASE_URL": driver_url(env.process_database_url, d)} if d else {})}
    runs: dict[str, dict[float, list[dict[str, float]]]] = {v: {r: [] for r in rates} for v in variants}
    with env:
        from relay.factory import create_outbox

        # The relay publishes to RabbitMQ itself, past the environment's fault-injection proxy.
        direct = {"OUTBOX_BROKER_URL": getattr(env.broker, "upstream_url", env.broker.url)}
        rabbit = broker_pid(direct["OUTBOX_BROKER_URL"])

        engine = make_engine(env.database_url, settings=env.settings, connect_args={"application_name": APP_NAME},
                             pool_size=args.clients + 2)
        sessions = make_session_factory(engine)
        outbox = create_outbox(env.settings, session_factory=sessions)
        table = outbox.tables.table(outbox.tables.outbox)

        def write(order_id: str, i: int) -> None:
            with sessions() as s:
                place_order(s, parse_order(order_body(order_id, index=i)), outbox=outbox)

        def pending() -> int:
            with sessions() as s:
                return int(s.execute(sa.select(sa.func.count()).select_from(table).where(
                    table.c.published_at_ms.is_(None))).scalar_one())

        def purge() -> None:
            with Connection(env.broker.url) as conn:
                ch = conn.channel()
                for name in env.settings.worker_queues:
                    try:
                        Queue(name, no_declare=True)(ch).purge()
                    except Exception:  # a queue nobody declared yet
                        ch = conn.channel()

        for rnd in range(args.rounds):
            order = list(variants) if rnd % 2 == 0 else list(variants)[::-1]
            for v in order:
                relay = env.processes.add(ManagedProcess(
                    name=f"relay-{v}-{rnd}", argv=relay_argv(), env={**env.env, **direct, **variants[v]},
                    log_dir=work / "logs", cwd=REPO))
                relay.start()
                env.wait(lambda relay=relay: "relay loop started" in relay.log_path.read_text(errors="replace"),  # type: ignore[misc]
                         what=f"relay {v} started")
                for i in range(20):  # warm-up: connections, declarations, statement caches
                    write(f"warm-{v}-{rnd}-{i}", i)
                env.wait(lambda: pending() == 0, what="warm-up drained")
                assert relay.pid is not None
                for rate in rates:
                    tag = f"{v}-{rnd}-{rate:g}"
                    t0_ms = int(time.time() * 1000)
                    cpu0, pg0, mq0 = cpu_s(relay.pid), backends_cpu_s(engine, env.db_name), cpu_s(rabbit)
                    n = offer(write, tag=tag, rate=rate, seconds=args.seconds, clients=args.clients)
                    env.wait(lambda: pending() == 0, timeout_s=120, what=f"{tag} drained")
                    cpu1, pg1, mq1 = cpu_s(relay.pid), backends_cpu_s(engine, env.db_name), cpu_s(rabbit)
                    pg = sum(c - pg0.get(pid, 0.0) for pid, c in pg1.items())
                    with sessions() as s:
                        lat = [float(x) for x in s.execute(
                            sa.select(table.c.published_at_ms - table.c.created_at_ms)
                            .where(table.c.created_at_ms >= t0_ms)).scalars()]
                        # a batch stamps its rows with one published_at_ms: distinct stamps ~ batches
                        batches = int(s.execute(sa.select(sa.func.count(sa.distinct(table.c.published_at_ms)))
                                                .where(table.c.created_at_ms >= t0_ms)).scalar_one())
                    got = {"orders": n, "relay_cpu_ms_per_order": 1000 * (cpu1 - cpu0) / n,
                           "pg_cpu_ms_per_order": 1000 * pg / n, "rabbitmq_cpu_ms_per_order": 1000 * (mq1 - mq0) / n,
                           "p50_ms": percentile(lat, 50),
                           "p99_ms": percentile(lat, 99), "orders_per_batch": n / max(1, batches)}
                    runs[v][rate].append(got)
                    print(f"  round {rnd} {v:9s} {rate:5.0f}/s: relay {got['relay_cpu_ms_per_order']:.2f} ms CPU/order, "
                          f"pg {got['pg_cpu_ms_per_order']:.2f}, rabbitmq {got['rabbitmq_cpu_ms_per_order']:.2f} ms/order, "
                          f"commit->published p50 {got['p50_ms']:.0f} "
                          f"p99 {got['p99_ms']:.0f} ms, {got['orders_per_batch']:.1f} orders/batch", flush=True)
                    purge()
                if relay.proc is not None:
                    relay.proc.send_signal(signal.SIGTERM)
                    relay.wait_exit(timeout_s=10)
        engine.dispose()
    first = next(iter(variants))
    med: dict[str, dict[str, dict[str, float]]] = {}
    print(f"\nmedians over {args.rounds} round(s); x = ratio to {first}")
    for rate in rates:
        for v in variants:
            m = {k: statistics.median(r[k] for r in runs[v][rate]) for k in runs[v][rate][0]}
            med.setdefault(v, {})[f"{rate:g}"] = m
            b = med[first][f"{rate:g}"]
            parts = ("relay_cpu_ms_per_order", "pg_cpu_ms_per_order", "rabbitmq_cpu_ms_per_order")
            total, btotal = sum(m[k] for k in parts), sum(b[k] for k in parts)
            print(f"  {rate:5.0f}/s {v:9s} relay {m['relay_cpu_ms_per_order']:.2f} + pg {m['pg_cpu_ms_per_order']:.2f} "
                  f"+ rabbitmq {m['rabbitmq_cpu_ms_per_order']:.2f} = {total:.2f} ms CPU/order (x{total / btotal:.2f})  "
                  f"p50 {m['p50_ms']:.0f} ms  p99 {m['p99_ms']:.0f} ms  "
                  f"{m['orders_per_batch']:.1f} orders/batch")
    write_result(args.name, {"rates": rates, "seconds_per_step": args.seconds, "rounds": args.rounds, "drivers": drivers,
                              "clients": args.clients, "variants": variants, "medians": med,
                              "runs": {v: {f"{r:g}": x for r, x in d.items()} for v, d in runs.items()},
                              "env": "outbox relay (LISTEN/NOTIFY), defaults but reconcile interval 1 day; "
                                     "RabbitMQ (direct, no proxy; its server's CPU counted); no worker"})


if __name__ == "__main__":
    main()
