"""The cost of safety at saturation: N orders pushed as fast as the pipeline takes them, outbox vs plain Celery.

For the headline figures use bench/sweep.py: it sweeps the client's commit rate and compares against plain
Celery on a plain worker with Celery's default configuration. This bench measures at one rate (its client's
fastest, where the relay gathers the most rows per batch) against a plain twin run on the outbox's own
worker (the gate and the deployment's configuration on plain tasks): use it for the profile and the hops.
Every process connects to RabbitMQ directly (no proxy in the path).

Real processes on the shared RabbitMQ (a namespace of their own), a database of their own, DEFAULT settings:

- a client process (``--client-threads`` threads, closed loop: each places its next order as soon as the
  previous one returned; no HTTP layer) that, per mode:
  - ``outbox``: the reference Orders service's ``place_order`` (order + ``OrderPlaced`` row + the
    confirmation e-mail task's row, one commit); ``outbox relay`` (LISTEN/NOTIFY) publishes, every
    consumer runs inbox + effect in one transaction, the e-mail task calls the provider, then its inbox row;
  - ``plain``: the same order without outbox rows, then after the commit one ``send_task`` (what
    ``.delay()`` does) per consumer and one for the plain e-mail task, publisher confirms OFF (what
    Celery does unless told) and no task-sent event (the relay sends none; otherwise the deployment's
    Celery configuration); the same prepare + handler and the same provider call, no inbox;
  - ``plain_confirms``: ``plain`` with kombu's ``confirm_publish`` transport option on (RabbitMQ);
- one ``celery worker`` of ``bench._worker`` (prefork, ``-c`` from ``--concurrency``, loglevel WARNING)
  shared by every mode; the relay runs in every mode (idle in the plain ones).

Per round the modes are interleaved (the order rotates), and a run is timed from the client's start to
the moment every order's four effects (three consumers + the e-mail) are committed (polled every
0.2 s in the consumers' tables and the provider's ``sent_emails``). CPU (utime + stime from
``/proc/<pid>/stat``) per order of: the worker parent, its pool children, the relay, the client,
the Postgres backends of each of those three (``application_name``), and the broker (``beam.smp``:
it includes whatever else uses the shared RabbitMQ at the time).

``tasks``: ``bench.touch(key)`` (insert one row, commit) sent with ``.delay()`` inside
``outbox.transaction`` (``tasks_outbox``: a business row and the task's row in one commit, the relay
publishes) vs a plain ``.delay()`` after the business row's commit (``tasks_plain``, confirms off), the
same task body on the same worker: tasks/s end to end and CPU per task per process.

Latency: ``bench/e2e_latency.py``'s ``run_broker`` reused as it is (RabbitMQ, 20 orders/s, ``-c 4``,
its own processes, INFO logging as in that bench): p50/p99 commit -> all four effects of an order.

Prints medians over ``--rounds`` and the ratios (outbox/plain, outbox/plain_confirms, tasks/plain
tasks, latency p99); writes bench/results/saturated.json. ``--quick``: 300 orders and 300 tasks, 1 round,
a short latency run (about 1.5 minutes). ``--profile`` (with ``--pg-admin-url`` of a PRIVATE Postgres that loads
pg_stat_statements, roles bench_client/bench_relay/bench_worker created, bench/README.md): one run per
mode at the first concurrency, statements per order per side from pg_stat_statements and py-spy
samples of the worker parent, a pool child, the relay and the client; writes
bench/results/saturated_profile.json (throughput under py-spy is not comparable, not reported).
``--hops``: the worker logs each task's receipt and its run in a pool process (bench/_worker.py), and each
run also reports the pool processes' share of wall time spent running tasks, the median run, the median
gap between one run and the next in a process, and the median wait from receipt to run: whether a mode is
bound by the pool's work or by what happens between deliveries (acks, prefetch, the parent).

    .venv/bin/python bench/saturated.py [--orders 1000] [--rounds 3] [--concurrency 2,4] [--quick]
        [--skip-tasks] [--skip-latency]
    .venv/bin/python bench/saturated.py --profile --pg-admin-url postgresql://postgres@127.0.0.1:5461/postgres
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import shutil
import signal
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

from bench._common import LineClient, write_result  # noqa: E402
from bench._worker import TOUCHED, create_touch_tables  # noqa: E402
from bench.consumer_cpu import broker_pids, children_of, cpu_ticks  # noqa: E402
from bench.sweep import DirectRabbit  # noqa: E402

ORDER_MODES = ("outbox", "plain", "plain_confirms")
TASK_MODES = ("tasks_outbox", "tasks_plain")
ROLES = ("client", "relay", "worker")
KINDS = ("worker_parent", "worker_children", "relay", "client", "pg_worker", "pg_relay", "pg_client", "broker")
TICKS = os.sysconf("SC_CLK_TCK")
PY_SPY = Path(sys.executable).parent / "py-spy"


# -- the client process ------------------------------------------------------------------------------
def client_main(threads: int) -> None:
    """Reads ``run <mode> <n> <tag>`` lines on stdin; places ``n`` orders (or tasks) closed loop from
    ``threads`` threads; answers one JSON line ``{"t0", "t1", "errors"}`` (wall clock, s)."""
    from bench._worker import (
        ITEMS,
        TOUCH,
        TOUCH_QUEUE,
        add_touch_task,
        place_plain_order,
        plain_celery,
        send_plain,
    )
    from celery_outbox.db import make_engine, make_session_factory
    from celeryconfig import Settings
    from chaos.load import order_body
    from orders.service import ORDER_PLACED, parse_order, place_order
    from relay.factory import create_outbox

    settings = Settings.from_env()
    engine = make_engine(settings.effective_database_url, pool_size=threads + 2)
    sessions = make_session_factory(engine)
    outbox = create_outbox(settings, session_factory=sessions)
    consumers = outbox.routes()[ORDER_PLACED]
    touch_queue = outbox.settings.queue_name(TOUCH_QUEUE)
    touch = add_touch_task(outbox.app, outbox.sessions, queue=touch_queue)
    # The relay sends no task-sent event, so neither does the plain twin (the worker's events are shared).
    plain = {False: plain_celery(outbox.settings, confirm_publish=False, sent_events=False),
             True: plain_celery(outbox.settings, confirm_publish=True, sent_events=False)}
    clock = outbox.clock

    def one(mode: str, key: str, i: int) -> None:
        if mode == "outbox":
            with sessions() as s:
                place_order(s, parse_order(order_body(key, index=i)), outbox=outbox)
        elif mode in ("plain", "plain_confirms"):
            req = parse_order(order_body(key, index=i))
            now = clock.now_ms()
            with sessions() as s:
                place_plain_order(s, req, now_ms=now)
            send_plain(plain[mode == "plain_confirms"], outbox.settings, consumers, req, now_ms=now)
        elif mode == "tasks_outbox":
            with sessions() as s:
                with outbox.transaction(s):
                    s.execute(ITEMS.insert().values(id=key))
                    touch.delay(key)
                s.commit()
        elif mode == "tasks_plain":
            with sessions() as s:
                s.execute(ITEMS.insert().values(id=key))
                s.commit()
            plain[False].send_task(TOUCH, args=[key], queue=touch_queue)
        else:
            raise ValueError(mode)

    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        _, mode, count, tag = cmd
        n = int(count)
        counter = itertools.count()
        errors: list[str] = []

        def loop(mode: str = mode, n: int = n, tag: str = tag, counter: Any = counter,
                 errors: list[str] = errors) -> None:
            while (i := next(counter)) < n:
                try:
                    one(mode, f"{tag}-{i}", i)
                except Exception as e:  # reported to the bench, which stops
                    errors.append(f"{type(e).__name__}: {e}")
                    return

        workers = [threading.Thread(target=loop) for _ in range(threads)]
        t0 = time.time()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        print(json.dumps({"t0": t0, "t1": time.time(), "errors": errors[:3]}), flush=True)
    engine.dispose()


# -- the bench side ------------------------------------------------------------------------------------
def role_url(base: str, role: str, *, as_user: bool) -> str:
    """The database URL a process of ``role`` uses: its own ``application_name`` (and with ``--profile`` its
    own login role, so pg_stat_statements separates the sides)."""
    url = sa.make_url(base).update_query_dict({"application_name": f"bench_{role}"})
    if as_user:
        url = url.set(username=f"bench_{role}")
    return url.render_as_string(hide_password=False)


class Rig:
    """The processes of one run of this bench and their CPU clocks."""

    def __init__(self, env: Any, work: Path, *, threads: int, profile: bool, hops: bool = False) -> None:
        from chaos.processes import ManagedProcess, relay_argv

        self.env, self.work, self.profile = env, work, profile
        self.hops_dir: Path | None = None  # set per worker with ``hops`` (``start_worker``)
        self.hops = hops
        from celery_outbox.db import make_engine

        self.monitor = make_engine(env.database_url)
        create_touch_tables(self.monitor)
        self.urls = {r: role_url(env.process_database_url, r, as_user=profile) for r in ROLES}
        self.relay = env.processes.add(ManagedProcess(
            name="relay", argv=relay_argv(), env={**env.env, "OUTBOX_DATABASE_URL": self.urls["relay"]},
            log_dir=work / "logs", cwd=ROOT))
        self.relay.start()
        self.client = LineClient([sys.executable, str(Path(__file__).resolve()), "--as-client",
                              "--client-threads", str(threads)],
                             {**os.environ, **env.env, "OUTBOX_DATABASE_URL": self.urls["client"],
                              "OUTBOX_CRASH_POINTS": ""}, work / "logs" / "client.log", cwd=ROOT)
        self.worker: Any = None

    def start_worker(self, concurrency: int) -> None:
        from chaos.processes import ManagedProcess, worker_argv

        if self.worker is not None:
            self.worker.stop()
        names = [q for q in self.env.settings.worker_queues if q != f"{self.env.namespace}.relay"]
        argv = worker_argv(queues=names, pool="prefork", concurrency=concurrency, app="bench._worker",
                           hostname=f"sat{concurrency}-{self.env.namespace}")
        argv[argv.index("--loglevel") + 1] = "WARNING"  # Celery's default: no log line per task
        env = {**self.env.env, "OUTBOX_DATABASE_URL": self.urls["worker"]}
        if self.hops:
            from bench._worker import HOPS_ENV

            self.hops_dir = self.work / f"hops-c{concurrency}"
            self.hops_dir.mkdir(exist_ok=True)
            env[HOPS_ENV] = str(self.hops_dir)
        self.worker = self.env.processes.add(ManagedProcess(
            name=f"worker-c{concurrency}", argv=argv, env=env, log_dir=self.work / "logs", cwd=ROOT))
        self.worker.start()

    def close(self) -> None:
        self.client.close()
        self.monitor.dispose()

    # -- what a run costs --------------------------------------------------------------------------
    def backends(self) -> dict[str, list[int]]:
        with self.monitor.connect() as c:
            rows = c.execute(sa.text("SELECT pid, application_name FROM pg_stat_activity "
                                     "WHERE datname = current_database()")).all()
        out: dict[str, list[int]] = {r: [] for r in ROLES}
        for pid, name in rows:
            role = str(name).removeprefix("bench_")
            if role in out:
                out[role].append(int(pid))
        return out

    def sample(self) -> dict[str, dict[int, int]]:
        wpid = self.worker.pid
        back = self.backends()
        return {"worker_parent": {wpid: cpu_ticks(wpid)},
                "worker_children": {p: cpu_ticks(p) for p in children_of(wpid)},
                "relay": {p: cpu_ticks(p) for p in [self.relay.pid, *children_of(self.relay.pid)]},
                "client": {self.client.proc.pid: cpu_ticks(self.client.proc.pid)},
                **{f"pg_{r}": {p: cpu_ticks(p) for p in back[r]} for r in ROLES},
                "broker": {p: cpu_ticks(p) for p in broker_pids()}}

    def done_count(self, mode: str) -> int:
        from consumers.effects import effect_counts

        with self.env.sessions() as s:
            if mode.startswith("tasks_"):
                return int(s.execute(sa.select(sa.func.count()).select_from(TOUCHED)).scalar_one())
            return sum(effect_counts(s).values())

    def run(self, mode: str, n: int, tag: str, *, per_order: int, timeout_s: float = 600) -> dict[str, float]:
        """One timed run: ``n`` orders (or tasks) through ``mode``; per-order CPU by process kind."""
        per = 1 if mode.startswith("tasks_") else per_order
        want = self.done_count(mode) + n * per
        before = self.sample()
        started = self.client.request(f"run {mode} {n} {tag}")
        deadline = time.monotonic() + timeout_s
        while self.done_count(mode) < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mode}: effects not all committed after {timeout_s:.0f} s\n{self.env.logs()}")
            if not self.worker.alive():
                raise RuntimeError(f"worker exited\n{self.env.logs()}")
            time.sleep(0.2)
        end = time.time()
        after = self.sample()
        out: dict[str, float] = {k: sum(t - before[k].get(p, 0) for p, t in after[k].items()) * 1000 / TICKS / n
                                 for k in KINDS}
        out["total_cpu_ms"] = sum(out[k] for k in KINDS)
        out["per_s"] = n / (end - started["t0"])
        out["client_s"] = started["t1"] - started["t0"]
        if self.hops_dir is not None:
            out.update(pool_hops(self.hops_dir, started["t0"] * 1000, end * 1000))
        return out


HOP_KEYS = ("busy_share", "run_ms", "gap_ms", "wait_ms")


def pool_hops(directory: Path, t0_ms: float, t1_ms: float) -> dict[str, float]:
    """What the pool processes did in [t0, t1] (``--hops``, bench/_worker.py's hop log): the share of the
    wall time they spent running tasks, the median run (task_prerun -> task_postrun), the median gap between
    a process's run and its next one, and the median wait from the parent's receipt to a process's start."""
    recv: dict[str, float] = {}
    per_pid: dict[str, list[tuple[float, float, str]]] = {}
    for path in directory.glob("hops-*.jsonl"):
        starts: dict[str, float] = {}
        runs: list[tuple[float, float, str]] = []
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # a line being written right now
                continue
            t = float(rec["t"])
            if rec["k"] == "recv":
                recv.setdefault(rec["id"], t)
            elif rec["k"] == "pre":
                starts[rec["id"]] = t
            elif rec["k"] == "post" and rec["id"] in starts and t0_ms <= starts[rec["id"]] <= t1_ms:
                runs.append((starts[rec["id"]], t, rec["id"]))
        if runs:
            per_pid[path.name] = sorted(runs)
    if not per_pid:
        return dict.fromkeys(HOP_KEYS, 0.0)
    run_ms = [b - a for runs in per_pid.values() for a, b, _ in runs]
    gaps = [nxt[0] - cur[1] for runs in per_pid.values() for cur, nxt in itertools.pairwise(runs)]
    waits = [a - recv[tid] for runs in per_pid.values() for a, _, tid in runs if tid in recv]
    return {"busy_share": sum(run_ms) / (len(per_pid) * max(1.0, t1_ms - t0_ms)),
            "run_ms": statistics.median(run_ms), "gap_ms": statistics.median(gaps) if gaps else 0.0,
            "wait_ms": statistics.median(waits) if waits else 0.0}


def effects_per_order(env: Any) -> int:
    from orders.service import ORDER_PLACED
    from relay.factory import create_outbox

    return len(create_outbox(env.settings, session_factory=env.sessions).routes()[ORDER_PLACED]) + 1


def median_runs(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}


def print_table(title: str, med: dict[str, dict[str, float]], modes: tuple[str, ...]) -> None:
    print(f"\n{title}")
    print(f"{'':18}" + "".join(f"{m:>16}" for m in modes))
    for k in ("per_s", *KINDS, "total_cpu_ms", *(h for h in HOP_KEYS if h in med[modes[0]])):
        print(f"{k:18}" + "".join(f"{med[m][k]:16.2f}" for m in modes))


def saturate(args: argparse.Namespace) -> dict[str, Any]:
    from bench.e2e_latency import default_env
    from chaos.environment import ChaosEnvironment

    work = Path(tempfile.mkdtemp(prefix="outbox-saturated-"))
    result: dict[str, Any] = {}
    env = ChaosEnvironment(broker="rabbitmq", workdir=work, extra_env=default_env())
    env.broker = DirectRabbit()  # no proxy in the path: every process talks to RabbitMQ directly
    with env:
        per_order = effects_per_order(env)
        rig = Rig(env, work, threads=args.client_threads, profile=False, hops=args.hops)
        try:
            for c in args.concurrency:
                rig.start_worker(c)
                modes = ORDER_MODES + (() if args.skip_tasks else TASK_MODES)
                for m in modes:  # warm-up (imports, connections, pools); waits for the worker too
                    rig.run(m, max(50, args.orders // 20), f"warm{c}-{m}", per_order=per_order, timeout_s=180)
                runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
                for r in range(args.rounds):
                    for group, n in ((ORDER_MODES, args.orders), (() if args.skip_tasks else TASK_MODES, args.tasks)):
                        order = group[r % len(group):] + group[:r % len(group)] if group else ()
                        for m in order:
                            out = rig.run(m, n, f"c{c}r{r}-{m}", per_order=per_order)
                            runs[m].append(out)
                            print(f"  -c {c} round {r} {m:15s} {out['per_s']:7.1f}/s  CPU {out['total_cpu_ms']:6.2f} "
                                  f"ms/{'task' if m.startswith('tasks') else 'order'}  (client done in "
                                  f"{out['client_s']:.1f} s)", flush=True)
                med = {m: median_runs(runs[m]) for m in modes}
                print_table(f"-c {c}: median of {args.rounds} rounds, {args.orders} orders ({args.tasks} tasks); "
                            f"CPU ms per order (per task) by process", med, modes)
                result[f"c{c}"] = {"median": med, "runs": runs}
        finally:
            rig.close()
    return result


def latency(args: argparse.Namespace) -> dict[str, Any]:
    from bench.e2e_latency import run_broker

    orders, rounds = (100, 1) if args.quick else (200, 3)
    res = run_broker("rabbitmq", orders=orders, rate=20.0, rounds=rounds, concurrency=4)
    key = "order: commit->all consumers and e-mail done"
    return {"orders_per_round": orders, "rounds": rounds, "rate_per_s": 20.0, "concurrency": 4,
            "outbox": res["outbox"][key], "plain": res["plain"][key],
            "per_delivery": {m: res[m]["commit->done"] for m in res}}


# -- profile ------------------------------------------------------------------------------------------
def folded_top(path: Path, *, top: int = 14) -> dict[str, Any]:
    """py-spy's raw (folded) stacks -> the functions with the most samples, inclusive and self."""
    total = 0
    incl: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f.split(":")[0] + ")" if ":" in f else f for f in stack.split(";")]
        frames = [f.replace(str(ROOT) + "/", "").replace(str(Path(sys.prefix)) + "/", "") for f in frames]
        for f in set(frames):
            incl[f] += n
        own[frames[-1]] += n
    return {"samples": total,
            "inclusive": [(f, round(100 * c / max(total, 1), 1)) for f, c in incl.most_common(top * 3)],
            "self": [(f, round(100 * c / max(total, 1), 1)) for f, c in own.most_common(top)]}


def statements(admin: sa.Engine, db: str) -> list[dict[str, Any]]:
    with admin.connect() as c:
        rows = c.execute(sa.text(
            "SELECT r.rolname, s.calls, s.rows, s.total_exec_time, s.query FROM pg_stat_statements s "
            "JOIN pg_roles r ON r.oid = s.userid JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = :db "
            "ORDER BY s.calls DESC"), {"db": db}).all()
    return [{"role": str(r[0]).removeprefix("bench_"), "calls": int(r[1]), "rows": int(r[2]),
             "ms": float(r[3]), "query": " ".join(str(r[4]).split())[:160]} for r in rows]


def profile(args: argparse.Namespace) -> dict[str, Any]:
    from bench.e2e_latency import default_env
    from celery_outbox.db import make_engine
    from chaos.environment import ChaosEnvironment

    work = Path(tempfile.mkdtemp(prefix="outbox-satprofile-"))
    admin = make_engine(args.pg_admin_url, isolation_level="AUTOCOMMIT")
    out: dict[str, Any] = {"orders": args.orders, "tasks": args.tasks, "concurrency": args.concurrency[0],
                           "py_spy": "--rate 100 --nonblocking" + (" --gil" if args.spy_gil else " (waits included)")}
    env = ChaosEnvironment(broker="rabbitmq", workdir=work, extra_env=default_env(), pg_admin_url=args.pg_admin_url)
    env.broker = DirectRabbit()
    with env:
        per_order = effects_per_order(env)
        rig = Rig(env, work, threads=args.client_threads, profile=True)
        try:
            rig.start_worker(args.concurrency[0])
            modes = tuple(args.profile_modes.split(",")) if args.profile_modes else ORDER_MODES + TASK_MODES
            for m in modes:
                rig.run(m, 50, f"warm-{m}", per_order=per_order, timeout_s=180)
            for m in modes:
                n = args.tasks if m.startswith("tasks_") else args.orders
                with admin.connect() as c:
                    c.exec_driver_sql("SELECT pg_stat_statements_reset()")
                spies: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
                children = children_of(rig.worker.pid)
                targets = {"worker_parent": rig.worker.pid, "pool_child": children[0], "relay": rig.relay.pid,
                           "client": rig.client.proc.pid}
                if shutil.which(str(PY_SPY)) and not args.no_py_spy:
                    for name, pid in targets.items():
                        path = work / f"spy-{m}-{name}.txt"
                        spies[name] = (subprocess.Popen([str(PY_SPY), "record", "--pid", str(pid), "--rate", "100",
                                                         "--format", "raw", "--output", str(path), "--nonblocking",
                                                         *(["--gil"] if args.spy_gil else [])],
                                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), path)
                    time.sleep(1.0)
                run = rig.run(m, n, f"prof-{m}", per_order=per_order)
                for proc, _ in spies.values():
                    proc.send_signal(signal.SIGINT)
                for proc, _ in spies.values():
                    proc.wait(timeout=60)
                stmts = statements(admin, env.db_name)
                per_role = {r: round(sum(s["calls"] for s in stmts if s["role"] == r) / n, 2) for r in ROLES}
                top = {r: [{**s, "per_unit": round(s["calls"] / n, 2)} for s in stmts if s["role"] == r][:25]
                       for r in ROLES}
                spy = {name: folded_top(path) for name, (_, path) in spies.items() if path.exists()}
                out[m] = {"n": n, "statements_per_unit": per_role, "top_statements": top, "py_spy": spy,
                          "cpu_ms_per_unit_under_py_spy": {k: round(run[k], 3) for k in (*KINDS, "total_cpu_ms")}}
                print(f"\n== {m} ({n}): statements per {'task' if m.startswith('tasks') else 'order'} by side: "
                      f"{per_role}", flush=True)
                for r in ROLES:
                    for s in top[r][:12]:
                        print(f"   {r:7s} {s['per_unit']:6.2f}  {s['query'][:130]}")
        finally:
            rig.close()
    admin.dispose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=None, help="orders per run (default 1000; --quick 300)")
    parser.add_argument("--tasks", type=int, default=None, help="tasks per run of the tasks comparison")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick 1)")
    parser.add_argument("--concurrency", default="2,4", help="worker pool sizes, comma separated")
    parser.add_argument("--client-threads", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="about 1.5 minutes: 300 orders, 1 round")
    parser.add_argument("--skip-tasks", action="store_true")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--hops", action="store_true",
                        help="the pool processes' busy share, run, gap and wait per task (bench/_worker.py hop log)")
    parser.add_argument("--profile", action="store_true", help="statements per side and py-spy (private Postgres)")
    parser.add_argument("--no-py-spy", action="store_true")
    parser.add_argument("--spy-gil", action="store_true",
                        help="--profile: py-spy samples only threads holding the GIL (Python CPU, not waits)")
    parser.add_argument("--profile-modes", default="", help="--profile: modes to run (default all)")
    parser.add_argument("--pg-admin-url", default=None, help="--profile: a private Postgres with pg_stat_statements")
    parser.add_argument("--name", default=None, help="bench/results/<name>.json")
    parser.add_argument("--as-client", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_client:
        client_main(args.client_threads)
        return
    args.orders = args.orders or (300 if args.quick else 1000)
    args.tasks = args.tasks or (300 if args.quick else 1000)
    args.rounds = args.rounds or (1 if args.quick else 3)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.exit(2, f"--concurrency: comma-separated integers, got {args.concurrency!r}\n")
    started = time.monotonic()
    if args.profile:
        if not args.pg_admin_url:
            parser.exit(2, "--profile needs --pg-admin-url of a private Postgres with pg_stat_statements\n")
        write_result(args.name or "saturated_profile", profile(args))
        return
    sat = saturate(args)
    lat = None if args.skip_latency else latency(args)
    ratios: dict[str, Any] = {}
    print(f"\nsaturated, RabbitMQ, prefork, median of {args.rounds} rounds of {args.orders} orders "
          f"(machine shared; same run):")
    for c in args.concurrency:
        med = sat[f"c{c}"]["median"]
        runs = sat[f"c{c}"]["runs"]

        def paired(a: str, b: str, runs: dict[str, list[dict[str, float]]] = runs) -> list[float]:
            """Per round, a's orders/s over b's (the same round, so the same neighbours on the machine)."""
            return [round(x["per_s"] / y["per_s"], 3) for x, y in zip(runs[a], runs[b], strict=True)]

        per_round = {"outbox_over_plain": paired("outbox", "plain"),
                     "outbox_over_plain_confirms": paired("outbox", "plain_confirms")}
        if "tasks_outbox" in runs:
            per_round["tasks_outbox_over_plain"] = paired("tasks_outbox", "tasks_plain")
        r = {"outbox_over_plain": med["outbox"]["per_s"] / med["plain"]["per_s"],
             "outbox_over_plain_confirms": med["outbox"]["per_s"] / med["plain_confirms"]["per_s"],
             "cpu_outbox_over_plain": med["outbox"]["total_cpu_ms"] / med["plain"]["total_cpu_ms"]}
        if "tasks_outbox" in med:
            r["tasks_outbox_over_plain"] = med["tasks_outbox"]["per_s"] / med["tasks_plain"]["per_s"]
        ratios[f"c{c}"] = {**{k: round(v, 3) for k, v in r.items()},
                           "per_round": per_round,
                           "median_per_round": {k: statistics.median(v) for k, v in per_round.items()}}
        line = (f"  -c {c}: orders/s outbox {med['outbox']['per_s']:.1f}, plain {med['plain']['per_s']:.1f}, "
                f"plain+confirms {med['plain_confirms']['per_s']:.1f}; ratio {r['outbox_over_plain']:.2f} "
                f"(vs confirms {r['outbox_over_plain_confirms']:.2f}); CPU ms/order {med['outbox']['total_cpu_ms']:.1f} "
                f"vs {med['plain']['total_cpu_ms']:.1f}")
        if "tasks_outbox" in med:
            line += (f"; tasks/s {med['tasks_outbox']['per_s']:.0f} vs {med['tasks_plain']['per_s']:.0f} "
                     f"({r['tasks_outbox_over_plain']:.2f}), client CPU ms/task {med['tasks_outbox']['client']:.2f} "
                     f"vs {med['tasks_plain']['client']:.2f}")
        print(line)
        print("        per round (same round, same neighbours): "
              + "; ".join(f"{k} {v} (median {statistics.median(v):.2f})" for k, v in per_round.items()))
    if lat is not None:
        o, p = lat["outbox"], lat["plain"]
        ratios["latency_p99_outbox_over_plain"] = round(o["p99_ms"] / max(p["p99_ms"], 0.001), 3)
        print(f"  latency at 20 orders/s, -c 4, commit -> all four effects: outbox p50 {o['p50_ms']:.1f} / p99 "
              f"{o['p99_ms']:.1f} ms, plain {p['p50_ms']:.1f} / {p['p99_ms']:.1f} ms; p99 ratio "
              f"{ratios['latency_p99_outbox_over_plain']:.2f} (bench/e2e_latency.py's run_broker)")
    print(f"  took {time.monotonic() - started:.0f} s")
    write_result(args.name or "saturated", {
        "broker": "rabbitmq (shared)", "orders": args.orders, "tasks": args.tasks, "rounds": args.rounds,
        "concurrency": args.concurrency, "client_threads": args.client_threads,
        "worker": "celery worker -A bench._worker -P prefork --loglevel WARNING (shared by every mode)",
        "relay": "outbox relay, LISTEN/NOTIFY, default settings", "ratios": ratios,
        "plain_client": "deployment's Celery config, task_send_sent_event off, confirm_publish off (plain) / on "
                        "(plain_confirms)", "saturated": sat,
        "latency": lat, "seconds": round(time.monotonic() - started)})


if __name__ == "__main__":
    main()
