"""The cost of safety at every commit rate: outbox vs plain Celery with Celery's defaults, CPU per order per process.

The bench that cannot flatter the outbox (bench/saturated.py measures at one rate, its client's fastest,
against a plain twin on the outbox's own worker). Here, per worker concurrency (``--concurrency``, prefork)
and per commit rate of the client (``--rates`` commits/s; ``0`` is unthrottled, a closed loop), three modes,
each with processes of its own, started afresh for every (concurrency, rate):

- ``outbox``: a client process placing orders with the reference Orders service's ``place_order`` (order +
  ``OrderPlaced`` row + the confirmation e-mail task's row, one commit), ``outbox relay`` (LISTEN/NOTIFY,
  default settings), and a ``celery worker -A relay.app`` (the deployment's app and configuration: the
  three consumers with the inbox, the e-mail task);
- ``plain``: a client process writing the same order without outbox rows, then after the commit one
  ``send_task`` per consumer and one for the e-mail (what ``.delay()`` does), from a Celery app with
  Celery's DEFAULT configuration (no publisher confirms, no task-sent event), and a ``celery worker -A
  bench._plain_worker``: Celery's default configuration too (acks before the run, prefetch multiplier 4),
  no gate, no inbox, the consumers' own ``prepare`` + handler and the same e-mail provider call on a plain
  SQLAlchemy engine (bench/_plain_worker.py); queues of its own;
- ``plain_confirms``: ``plain`` with kombu's ``confirm_publish`` on the client (RabbitMQ publisher
  confirms), its own worker and queues.

Every worker runs ``-P prefork -c N --loglevel WARNING --without-gossip --without-mingle --without-heartbeat``
(the same flags for all). Every process talks to RabbitMQ and Postgres DIRECTLY: no proxy in the path.

The client paces its commits open loop (order ``i`` is due at ``start + i / rate``, ``--client-threads``
threads take the next due order) and records each commit's wall-clock instant. A run of ``n`` orders
(``rate * --seconds``, within ``--min-orders``..``--max-orders``; unthrottled: ``--max-orders``) is timed
from the client's start to the last effect of its last order (the rows' own timestamps: shipment,
invoice, search document, e-mail sent; each stamped when its task started its transaction, the same on
both sides). Per order, latency is commit -> the last of its four effects (p50/p99).

CPU: utime + stime from ``/proc/<pid>/stat`` before and after each run, per order, of every process in the
mode's path: the client, the relay (outbox only), the worker parent, its pool processes, each Postgres
backend of those (by ``application_name``), and RabbitMQ's ``beam.smp`` (shared: it includes whatever else
uses the broker meanwhile). Postgres's own auxiliary processes (WAL writer, checkpointer, background writer,
autovacuum) serve every database on the server: reported apart as ``pg_aux``, not in ``total``.

Rounds: per (concurrency, rate) ``--rounds`` rounds, the three modes interleaved in a rotating order so
machine drift hits all alike. Round 0 is FRESH (the first orders those processes ever handle, after their
start-up is done and before any warm-up); rounds 1.. are WARMED (their median is reported). Prints, per
concurrency and rate, orders/s and CPU per order of each mode and the ratios; writes
bench/results/sweep.json (``--name``).

    .venv/bin/python bench/sweep.py [--rates 25,50,100,150,250,0] [--concurrency 2,4] [--rounds 3]
        [--seconds 5] [--min-orders 100] [--max-orders 300] [--quick] [--driver psycopg2|psycopg]

``--driver``: every process's Postgres driver, the plain twins' as the outbox's (psycopg 3 prepares a statement on
the server after 5 runs on a connection; psycopg2 never does).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from bench._common import PG_ADMIN_URL, LineClient, add_driver_option, driver_url, percentile, write_result  # noqa: E402
from bench.consumer_cpu import broker_pids, children_of, cpu_ticks  # noqa: E402
from chaos.broker import RabbitBroker  # noqa: E402

MODES = ("outbox", "plain", "plain_confirms")
KINDS = ("client", "relay", "worker_parent", "worker_pool", "pg_client", "pg_relay", "pg_worker", "broker")
TICKS = os.sysconf("SC_CLK_TCK")
PLAIN_QUEUE_ENV = "BENCH_SWEEP_QUEUE_PREFIX"


class DirectRabbit(RabbitBroker):
    """The shared RabbitMQ with no proxy in front: the processes connect to it directly (the chaos
    environment's cuttable loopback proxy is a Python process of its own whose CPU nobody would count)."""

    @property
    def url(self) -> str:
        return self.upstream_url

    def start(self) -> None:
        return None


# -- the client process -------------------------------------------------------------------------------
def client_main(mode: str, threads: int) -> None:
    """Builds the mode's sending side, prints ``ready``; then reads ``run <n> <rate> <tag>`` lines on stdin,
    places ``n`` orders at ``rate`` commits/s (0: as fast as ``threads`` closed loops go) and answers one JSON
    line ``{"t0", "t1", "errors", "commit_ms"}`` (wall clock; ``commit_ms[i]`` is order ``i``'s commit)."""
    from celery_outbox.db import normalize_url
    from celeryconfig import Settings
    from chaos.load import order_body
    from orders.service import ORDER_PLACED, parse_order

    settings = Settings.from_env()
    if mode == "outbox":
        from celery_outbox.db import make_engine, make_session_factory
        from orders.service import place_order
        from relay.factory import create_outbox

        engine = make_engine(settings.effective_database_url, pool_size=threads + 2)
        sessions = make_session_factory(engine)
        outbox = create_outbox(settings, session_factory=sessions)

        def one(key: str, i: int) -> None:
            with sessions() as s:
                place_order(s, parse_order(order_body(key, index=i)), outbox=outbox)
    else:
        from sqlalchemy.orm import sessionmaker

        from bench._plain_worker import plain_client, queue_names, send_order
        from bench._worker import place_plain_order
        from consumers import default_registry

        engine = sa.create_engine(normalize_url(settings.effective_database_url), pool_size=threads + 2)
        plain_sessions = sessionmaker(engine)
        app = plain_client(settings.broker_url, confirm_publish=mode == "plain_confirms")
        queues = queue_names(os.environ[PLAIN_QUEUE_ENV])
        consumers = [spec.name for spec in default_registry() if ORDER_PLACED in spec.events]

        def one(key: str, i: int) -> None:
            req = parse_order(order_body(key, index=i))
            now = int(time.time() * 1000)
            with plain_sessions() as s:
                place_plain_order(s, req, now_ms=now)
            send_order(app, queues, consumers, req, now_ms=now)

    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        _, count, rate_s, tag = cmd
        n, rate = int(count), float(rate_s)
        counter = itertools.count()
        errors: list[str] = []
        commits = [0.0] * n
        start = time.monotonic() + 0.02

        def loop(n: int = n, rate: float = rate, tag: str = tag, counter: Any = counter,
                 errors: list[str] = errors, commits: list[float] = commits, start: float = start) -> None:
            while (i := next(counter)) < n:
                if rate > 0:
                    wait = start + i / rate - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                try:
                    one(f"{tag}-{i}", i)
                except Exception as e:  # reported to the bench, which stops
                    errors.append(f"{type(e).__name__}: {e}")
                    return
                commits[i] = time.time() * 1000

        workers = [threading.Thread(target=loop) for _ in range(threads)]
        t0 = time.time() + max(0.0, start - time.monotonic())
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        print(json.dumps({"t0": t0, "t1": time.time(), "errors": errors[:3], "commit_ms": commits}), flush=True)
    engine.dispose()


# -- the bench side -----------------------------------------------------------------------------------
def role_url(base: str, role: str) -> str:
    """The database URL of one process: its own ``application_name``, so its backends can be found."""
    return sa.make_url(base).update_query_dict({"application_name": f"bench_{role}"}).render_as_string(
        hide_password=False)


def plain_queue_prefix(namespace: str, mode: str) -> str:
    return f"{namespace}.{mode}"


class Stage:
    """Every process of one (concurrency, rate): the three modes' clients and workers and the relay, started
    together and stopped together (each stage's processes are fresh)."""

    def __init__(self, env: Any, work: Path, *, concurrency: int, threads: int, label: str) -> None:
        from bench._plain_worker import queue_names
        from chaos.processes import BIN, ManagedProcess, relay_argv, worker_argv

        self.env, self.label = env, label
        base = env.process_database_url
        self.relay = env.processes.add(ManagedProcess(
            name=f"relay-{label}", argv=relay_argv(),
            env={**env.env, "OUTBOX_DATABASE_URL": role_url(base, "relay")}, log_dir=work / "logs", cwd=ROOT))
        self.workers: dict[str, Any] = {}
        self.queues: dict[str, list[str]] = {}
        for mode in MODES:
            if mode == "outbox":
                queues = [q for q in env.settings.worker_queues if q != f"{env.namespace}.relay"]
                argv = worker_argv(queues=queues, pool="prefork", concurrency=concurrency, app="relay.app",
                                   hostname=f"sweep-{mode}-{label}")
            else:
                queues = list(queue_names(plain_queue_prefix(env.namespace, mode)).values())
                argv = [str(BIN / "celery"), "-A", "bench._plain_worker", "worker", "-Q", ",".join(queues),
                        "-P", "prefork", "-c", str(concurrency), "--without-gossip", "--without-mingle",
                        "--without-heartbeat", "-n", f"sweep-{mode}-{label}@%h", "--loglevel", "INFO"]
            argv[argv.index("--loglevel") + 1] = "WARNING"  # Celery's default: no log line per task
            self.queues[mode] = queues
            self.workers[mode] = env.processes.add(ManagedProcess(
                name=f"worker-{mode}-{label}", argv=argv,
                env={**env.env, "OUTBOX_DATABASE_URL": role_url(base, f"worker_{mode}")},
                log_dir=work / "logs", cwd=ROOT))
        self.clients: dict[str, LineClient] = {}
        self._client_args = (work, threads)

    def start(self) -> None:
        work, threads = self._client_args
        self.relay.start()
        for w in self.workers.values():
            w.start()
        for mode in MODES:
            self.clients[mode] = LineClient(
                [sys.executable, str(Path(__file__).resolve()), "--as-client", mode, "--client-threads", str(threads)],
                {**os.environ, **self.env.env, "OUTBOX_CRASH_POINTS": "",
                 "OUTBOX_DATABASE_URL": role_url(self.env.process_database_url, f"client_{mode}"),
                 PLAIN_QUEUE_ENV: plain_queue_prefix(self.env.namespace, mode)},
                work / "logs" / f"client-{mode}-{self.label}.log", cwd=ROOT)
        for c in self.clients.values():
            c.wait_ready()
        self._wait_consumers()
        deadline = time.monotonic() + 60
        while not backends(self.env)["relay"]:
            if time.monotonic() > deadline or not self.relay.alive():
                raise RuntimeError(f"relay did not connect\n{self.env.logs()}")
            time.sleep(0.2)
        time.sleep(2.0)  # start-up tails (imports, pool forks) settle before the first measured run

    def _wait_consumers(self, timeout_s: float = 90) -> None:
        """Until every worker consumes every one of its queues (its pool is up before its consumer starts)."""
        from kombu import Connection

        deadline = time.monotonic() + timeout_s
        with Connection(self.env.broker.upstream_url, connect_timeout=5) as conn:
            for mode, queues in self.queues.items():
                for q in queues:
                    while True:
                        try:
                            channel = conn.channel()
                            try:
                                consumers = channel.queue_declare(queue=q, passive=True).consumer_count
                            finally:
                                channel.close()
                        except Exception:  # not declared yet: the channel is closed by the server
                            conn.ensure_connection(max_retries=3)
                            consumers = 0
                        if consumers > 0:
                            break
                        if time.monotonic() > deadline or not self.workers[mode].alive():
                            raise RuntimeError(f"worker {mode}: no consumer on {q}\n{self.env.logs()}")
                        time.sleep(0.2)

    def stop(self) -> None:
        for c in self.clients.values():
            c.close()
        procs = [self.relay, *self.workers.values()]
        with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p: p.stop(), procs))

    # -- what a run costs ------------------------------------------------------------------------------
    def sample(self, mode: str) -> dict[str, dict[int, int]]:
        back = backends(self.env)
        wpid = self.workers[mode].pid
        client = self.clients[mode].proc.pid
        relay = [self.relay.pid, *children_of(self.relay.pid)] if mode == "outbox" else []
        return {"client": {client: cpu_ticks(client)},
                "relay": {p: cpu_ticks(p) for p in relay},
                "worker_parent": {wpid: cpu_ticks(wpid)},
                "worker_pool": {p: cpu_ticks(p) for p in children_of(wpid)},
                "pg_client": {p: cpu_ticks(p) for p in back[f"client_{mode}"]},
                "pg_relay": {p: cpu_ticks(p) for p in (back["relay"] if mode == "outbox" else [])},
                "pg_worker": {p: cpu_ticks(p) for p in back[f"worker_{mode}"]},
                "pg_aux": {p: cpu_ticks(p) for p in back["aux"]},
                "broker": {p: cpu_ticks(p) for p in broker_pids()}}

    def run(self, mode: str, n: int, rate: float, tag: str, *, timeout_s: float = 600) -> dict[str, Any]:
        """One timed run of ``n`` orders through ``mode`` at ``rate``: throughput, latency, CPU per order."""
        worker = self.workers[mode]
        want = done_count(self.env) + 4 * n
        before = self.sample(mode)
        sent = self.clients[mode].request(f"run {n} {rate} {tag}")
        deadline = time.monotonic() + timeout_s
        while done_count(self.env) < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mode}: effects not all committed after {timeout_s:.0f} s\n{self.env.logs()}")
            if not worker.alive():
                raise RuntimeError(f"worker {mode} exited\n{self.env.logs()}")
            time.sleep(0.1)
        after = self.sample(mode)
        cpu = {k: sum(t - before[k].get(p, 0) for p, t in after[k].items()) * 1000 / TICKS / n
               for k in (*KINDS, "pg_aux")}
        done = effects_done_ms(self.env, tag)
        lat = [done[f"{tag}-{i}"] - c for i, c in enumerate(sent["commit_ms"])]
        end_ms = max(done.values())
        return {"mode": mode, "n": n, "rate": rate,
                "per_s": n / (end_ms / 1000 - sent["t0"]),
                "commits_per_s": n / (sent["t1"] - sent["t0"]),
                "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
                "cpu_ms": {k: round(v, 4) for k, v in cpu.items()},
                "total_cpu_ms": sum(cpu[k] for k in KINDS)}


def backends(env: Any) -> dict[str, list[int]]:
    """This database's client backends by role (``application_name`` ``bench_<role>``), and the server's
    auxiliary processes (``aux``: WAL writer, checkpointer, background writer, autovacuum)."""
    with env.sessions() as s:
        rows = s.execute(sa.text("SELECT pid, application_name, datname, backend_type FROM pg_stat_activity")).all()
    out: dict[str, list[int]] = {"relay": [], "aux": [], **{f"{r}_{m}": [] for r in ("client", "worker")
                                                             for m in MODES}}
    for pid, name, db, kind in rows:
        if kind != "client backend":
            if kind not in ("walsender", "background worker") and pid is not None:
                out["aux"].append(int(pid))
        elif db == env.db_name and str(name or "").startswith("bench_"):
            role = str(name).removeprefix("bench_")
            if role in out:
                out[role].append(int(pid))
    return out


def done_count(env: Any) -> int:
    from consumers.effects import effect_counts

    with env.sessions() as s:
        return sum(effect_counts(s).values())


def effects_done_ms(env: Any, tag: str) -> dict[str, float]:
    """Order id -> the instant of the last of its four effects (the rows' own timestamps)."""
    from consumers.models import Invoice, SearchDocument, SentEmail, Shipment

    like = f"{tag}-%"
    last: dict[str, float] = {}
    with env.sessions() as s:
        rows: list[Any] = []
        for model, at in ((Shipment, Shipment.created_at_ms), (Invoice, Invoice.created_at_ms),
                          (SearchDocument, SearchDocument.updated_at_ms)):
            rows += s.execute(sa.select(model.order_id, at).where(model.order_id.like(like))).all()
        for subject, at in s.execute(sa.select(SentEmail.subject, SentEmail.sent_at_ms)
                                     .where(SentEmail.subject.like(f"Order {like}"))).all():
            rows.append((str(subject).removeprefix("Order ").removesuffix(" confirmed"), at))
    for order_id, at in rows:
        last[order_id] = max(last.get(order_id, 0.0), float(at))
    return last


def orders_for(rate: float, args: argparse.Namespace) -> int:
    if rate <= 0:
        return int(args.max_orders)
    return int(min(args.max_orders, max(args.min_orders, rate * args.seconds)))


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of ``runs`` (one mode, one phase) figure by figure."""
    def med(values: list[float]) -> float:
        return round(statistics.median(values), 3)

    return {"rounds": len(runs), "n": [r["n"] for r in runs],
            **{k: med([r[k] for r in runs]) for k in ("per_s", "commits_per_s", "p50_ms", "p99_ms", "total_cpu_ms")},
            "cpu_ms": {k: med([r["cpu_ms"][k] for r in runs]) for k in (*KINDS, "pg_aux")}}


def ratios(phase: dict[str, dict[str, Any]]) -> dict[str, float]:
    o, p, pc = phase["outbox"], phase["plain"], phase["plain_confirms"]
    return {"orders_outbox_over_plain": round(o["per_s"] / p["per_s"], 3),
            "orders_outbox_over_plain_confirms": round(o["per_s"] / pc["per_s"], 3),
            "cpu_outbox_over_plain": round(o["total_cpu_ms"] / p["total_cpu_ms"], 3),
            "cpu_outbox_over_plain_confirms": round(o["total_cpu_ms"] / pc["total_cpu_ms"], 3),
            "p99_outbox_over_plain": round(o["p99_ms"] / max(p["p99_ms"], 0.001), 3)}


def rate_label(rate: float) -> str:
    return "unthrottled" if rate <= 0 else f"{rate:g}/s"


def print_stage(c: int, rate: float, summary: dict[str, Any]) -> None:
    for phase in ("fresh", "warmed"):
        s = summary.get(phase)
        if not s:
            continue
        r = summary[f"ratios_{phase}"]
        print(f"  -c {c} {rate_label(rate):>11} {phase:6}: orders/s " + " / ".join(
            f"{s[m]['per_s']:.1f}" for m in MODES) + "  CPU ms/order " + " / ".join(
            f"{s[m]['total_cpu_ms']:.2f}" for m in MODES) + "  p50/p99 ms " + " / ".join(
            f"{s[m]['p50_ms']:.0f}-{s[m]['p99_ms']:.0f}" for m in MODES)
            + f"  | orders {r['orders_outbox_over_plain']:.2f}x plain, {r['orders_outbox_over_plain_confirms']:.2f}x "
              f"confirms; CPU {r['cpu_outbox_over_plain']:.2f}x plain, {r['cpu_outbox_over_plain_confirms']:.2f}x "
              f"confirms; p99 {r['p99_outbox_over_plain']:.2f}x plain", flush=True)


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    from bench.e2e_latency import default_env
    from chaos.environment import ChaosEnvironment

    work = Path(tempfile.mkdtemp(prefix="outbox-sweep-"))
    (work / "logs").mkdir(parents=True, exist_ok=True)
    env = ChaosEnvironment(broker="rabbitmq", workdir=work, extra_env=default_env(),
                           pg_admin_url=driver_url(PG_ADMIN_URL, args.driver))
    env.broker = DirectRabbit()
    out: dict[str, Any] = {"runs": [], "summary": {}}
    print(f"modes (each column): {' / '.join(MODES)}; driver {sa.make_url(env.database_url).drivername}; "
          f"logs in {work}", flush=True)
    with env:
        try:
            for c in args.concurrency:
                for rate in args.rates:
                    label = f"c{c}-{rate_label(rate).replace('/s', '')}"
                    stage = Stage(env, work, concurrency=c, threads=args.client_threads, label=label)
                    try:
                        t = time.monotonic()
                        stage.start()
                        print(f"  -c {c} {rate_label(rate)}: 7 processes started in {time.monotonic() - t:.0f} s",
                              flush=True)
                        n = orders_for(rate, args)
                        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
                        for r in range(args.rounds):
                            for m in MODES[r % 3:] + MODES[:r % 3]:
                                res = stage.run(m, n, rate, f"{label}-r{r}-{MODES.index(m)}")
                                res.update(concurrency=c, round=r, phase="fresh" if r == 0 else "warmed")
                                runs[m].append(res)
                                out["runs"].append(res)
                    finally:
                        stage.stop()
                    summary: dict[str, Any] = {"orders_per_run": n}
                    for phase, pick in (("fresh", slice(0, 1)), ("warmed", slice(1, None))):
                        if all(runs[m][pick] for m in MODES):
                            summary[phase] = {m: summarize(runs[m][pick]) for m in MODES}
                            summary[f"ratios_{phase}"] = ratios(summary[phase])
                    out["summary"].setdefault(f"c{c}", {})[rate_label(rate)] = summary
                    print_stage(c, rate, summary)
        finally:
            delete_plain_queues(env)
    return out


def delete_plain_queues(env: Any) -> None:
    import contextlib

    from kombu import Connection, Queue

    from bench._plain_worker import queue_names

    with contextlib.suppress(Exception), Connection(env.broker.upstream_url, connect_timeout=5) as conn:
        channel = conn.channel()
        for mode in MODES[1:]:
            for q in queue_names(plain_queue_prefix(env.namespace, mode)).values():
                with contextlib.suppress(Exception):
                    Queue(q, channel=channel).delete()


def print_tables(args: argparse.Namespace, res: dict[str, Any]) -> None:
    """Per concurrency and phase: CPU ms per order by process kind, each rate and mode."""
    for c in args.concurrency:
        for phase in ("warmed", "fresh"):
            print(f"\n-c {c}, {phase}: CPU ms per order by process (outbox / plain / plain_confirms)")
            print(f"{'rate':>12}" + "".join(f"{k:>22}" for k in (*KINDS, "pg_aux")))
            for rate in args.rates:
                s = res["summary"][f"c{c}"][rate_label(rate)].get(phase)
                if s:
                    cells = [" / ".join(f"{s[m]['cpu_ms'][k]:.2f}" for m in MODES) for k in (*KINDS, "pg_aux")]
                    print(f"{rate_label(rate):>12}" + "".join(f"{cell:>22}" for cell in cells))


def uptime() -> str:
    return Path("/proc/loadavg").read_text().strip()


def git_head() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default=None, help="client commits/s, comma separated; 0 = unthrottled "
                                                      "(default 25,50,100,150,250,0; --quick 25,0)")
    parser.add_argument("--concurrency", default=None, help="worker pool sizes (default 2,4; --quick 2)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per rate: the first fresh, the others warmed (default 3; --quick 2)")
    parser.add_argument("--seconds", type=float, default=None, help="a run's length at its rate (default 5)")
    parser.add_argument("--min-orders", type=int, default=None, help="orders per run at least (default 100)")
    parser.add_argument("--max-orders", type=int, default=None, help="orders per run at most (default 300)")
    parser.add_argument("--client-threads", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a smoke test: -c 2, 25/s and unthrottled, tiny runs")
    parser.add_argument("--name", default=None, help="bench/results/<name>.json (default sweep; --quick sweep_quick)")
    add_driver_option(parser)
    parser.add_argument("--as-client", default=None, choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_client:
        client_main(args.as_client, args.client_threads)
        return
    q = args.quick
    try:
        args.rates = [float(r) for r in (args.rates or ("25,0" if q else "25,50,100,150,250,0")).split(",")]
        args.concurrency = [int(c) for c in (args.concurrency or ("2" if q else "2,4")).split(",")]
    except ValueError:
        parser.exit(2, "--rates and --concurrency: comma-separated numbers\n")
    args.rounds = args.rounds or (2 if q else 3)
    args.seconds = args.seconds or (2.0 if q else 5.0)
    args.min_orders = args.min_orders or (40 if q else 100)
    args.max_orders = args.max_orders or (100 if q else 300)
    started, load_before = time.monotonic(), uptime()
    res = sweep(args)
    print_tables(args, res)
    load_after = uptime()
    print(f"\nmain commit {git_head()}; load (/proc/loadavg) before {load_before}, after {load_after}; "
          f"took {time.monotonic() - started:.0f} s")
    write_result(args.name or ("sweep_quick" if q else "sweep"), {
        "commit": git_head(), "broker": "rabbitmq (shared server, direct: no proxy)", "driver": args.driver,
        "rates": args.rates, "concurrency": args.concurrency, "rounds": args.rounds,
        "phases": "round 0 fresh (processes started for this rate, no warm-up), rounds 1.. warmed (median)",
        "seconds": args.seconds, "min_orders": args.min_orders, "max_orders": args.max_orders,
        "client_threads": args.client_threads, "load_before": load_before, "load_after": load_after,
        "took_s": round(time.monotonic() - started), **res})


if __name__ == "__main__":
    main()
