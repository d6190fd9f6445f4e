"""The cost of safety end to end: Orders over HTTP -> relay -> every consumer and the e-mail, vs plain Celery.

Real processes on one broker (RabbitMQ by default; ``--broker redis`` runs an own redis-server with
appendfsync always), DEFAULT settings:

- ``outbox``: ``gunicorn relay.wsgi:app`` (the reference Orders service: order + OrderPlaced row +
  the confirmation e-mail task's row in one commit), ``outbox relay`` (LISTEN/NOTIFY), consumers with
  inbox + effect in one transaction, the e-mail task (orders/tasks.py: provider call, then its inbox row);
- ``plain``: ``gunicorn bench._plain_web:app`` (the same endpoint without outbox rows; after the
  commit one ``send_task`` per consumer and one for a plain e-mail task, what ``.delay()`` does), the
  same effects through the same provider, no inbox.

Both modes use the SAME ``celery worker`` (prefork, concurrency 2) of ``bench._worker`` (the
deployment's app: ``relay.factory.create_outbox``, i.e. ``consumers.register`` + ``orders.tasks.register``,
plus a plain twin of every consumer and of the e-mail task; it consumes ``Settings.worker_queues`` but
the relay's, as the relay is its own process), the same gunicorn shape and the same database. For
each offered rate (a ladder), this script POSTs orders at that rate for ``--seconds`` from
``--clients`` threads (keep-alive connections, open loop: a thread that falls behind sends at once)
and times first request -> every consumer's effect and every order's e-mail committed (counted in the
consumers' own tables and the provider's ``sent_emails``, ``consumers.effects``). Completed orders /
that time is the rate the whole pipeline sustained at that offer; a mode's figure is its best step.
Rounds interleave the modes; prints each step, the median over rounds and outbox / plain
(target >= 0.8). Writes bench/results/pipeline.json.

    .venv/bin/python bench/pipeline.py [--rates 20,40,80,160] [--seconds 8] [--rounds 3] [--broker rabbitmq]
        [--worker-conf '{"worker_send_task_events": false}' --name pipeline_events_off]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_result
from bench._worker import CONF_ENV
from bench.e2e_latency import default_env
from chaos.environment import ChaosEnvironment
from chaos.load import order_body
from chaos.processes import BIN, ManagedProcess, worker_argv
from consumers.effects import effect_counts
from orders.service import ORDER_PLACED
from relay.embedded import free_port

MODES = ("outbox", "plain")
APPS = {"outbox": "relay.wsgi:app", "plain": "bench._plain_web:app"}
REPO = Path(__file__).resolve().parent.parent


def gunicorn(env: ChaosEnvironment, mode: str, port: int) -> ManagedProcess:
    """Two gthread workers (4 threads each): the HTTP side is never what limits a 2-core run."""
    argv = [str(BIN / "gunicorn"), "-w", "2", "-k", "gthread", "--threads", "4", "-b", f"127.0.0.1:{port}",
            APPS[mode]]
    return env.processes.add(ManagedProcess(name=f"web-{mode}", argv=argv, env=env.env,
                                            log_dir=env.workdir / "logs", cwd=REPO))


def healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/healthz")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def offer(port: int, *, tag: str, rate: float, seconds: float, clients: int) -> tuple[int, int, float]:
    """POST ``rate * seconds`` orders at ``rate``/s; returns (accepted, refused, seconds the offer took)."""
    total = round(rate * seconds)
    period = 1.0 / rate
    accepted = [0] * clients
    refused = [0] * clients
    start = time.perf_counter() + 0.05

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for i in range(k, total, clients):
            delay = start + i * period - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            body = json.dumps(order_body(f"{tag}-{i}", index=i))
            conn.request("POST", "/orders", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            if resp.status == 201:
                accepted[k] += 1
            else:
                refused[k] += 1
        conn.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(accepted), sum(refused), time.perf_counter() - start


def effects_total(env: ChaosEnvironment) -> int:
    """Every consumer's effects plus the e-mails sent (distinct provider keys: one per order either way)."""
    with env.sessions() as s:
        return sum(effect_counts(s).values())


def step(env: ChaosEnvironment, port: int, *, mode: str, tag: str, rate: float, seconds: float, clients: int,
         per_order: int) -> dict[str, Any]:
    before = effects_total(env)
    t0 = time.perf_counter()
    accepted, refused, offered_s = offer(port, tag=tag, rate=rate, seconds=seconds, clients=clients)
    want = before + accepted * per_order
    deadline = time.perf_counter() + 300
    while effects_total(env) < want:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{mode} at {rate}/s: effects not done after 300 s\n{env.logs()}")
        time.sleep(0.05)
    elapsed = time.perf_counter() - t0
    return {"offered_per_s": rate, "accepted": accepted, "refused": refused,
            "http_per_s": round(accepted / offered_s, 1), "drain_s": round(elapsed - offered_s, 2),
            "sustained_per_s": round(accepted / elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", default="20,40,80,160", help="offered orders/s, ascending")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each offer")
    parser.add_argument("--worker-conf", default="",
                        help="JSON Celery settings laid over the deployment's in the worker (a knob experiment)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8, help="HTTP client threads")
    parser.add_argument("--name", default="pipeline", help="bench/results/<name>.json")
    parser.add_argument("--broker", default="rabbitmq", choices=("rabbitmq", "redis"))
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    work = Path(tempfile.mkdtemp(prefix="outbox-pipeline-"))
    best: dict[str, list[float]] = {m: [] for m in MODES}
    steps: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in MODES}
    with ChaosEnvironment(broker=args.broker, workdir=work, extra_env={**default_env(), CONF_ENV: args.worker_conf}) as env:
        from relay.factory import create_outbox

        # One effect per consumer of OrderPlaced plus the confirmation e-mail (orders/tasks.py).
        per_order = len(create_outbox(env.settings, session_factory=env.sessions).routes()[ORDER_PLACED]) + 1
        env.relay().start()
        # What a worker of the deployment consumes, but the relay's queue (the relay is its own process).
        names = [q for q in env.settings.worker_queues if q != f"{env.namespace}.relay"]
        worker = env.processes.add(ManagedProcess(
            name="worker", env=env.env, log_dir=work / "logs", cwd=REPO,
            argv=worker_argv(queues=names, pool="prefork", concurrency=2, app="bench._worker",
                             hostname=f"pipeline-{env.namespace}")))
        worker.start()
        ports = {m: free_port() for m in MODES}
        for m in MODES:
            gunicorn(env, m, ports[m]).start()
        env.wait(lambda: "ready" in worker.log_path.read_text(errors="replace"), what="worker ready")
        for port in ports.values():
            env.wait(lambda port=port: healthy(port), what=f"web server on port {port}")  # type: ignore[misc]
        for m in MODES:  # warm-up: connections, pools, statement caches; not measured
            step(env, ports[m], mode=m, tag=f"warm-{m}", rate=rates[0], seconds=2.0, clients=args.clients,
                 per_order=per_order)
        for r in range(args.rounds):
            for m in MODES if r % 2 == 0 else MODES[::-1]:
                ladder = []
                for rate in rates:
                    s = step(env, ports[m], mode=m, tag=f"{m}-{r}-{rate:g}", rate=rate, seconds=args.seconds,
                             clients=args.clients, per_order=per_order)
                    ladder.append(s)
                    print(f"  round {r} {m:6s} offered {rate:5.0f}/s: http {s['http_per_s']:6.1f}/s, drain "
                          f"{s['drain_s']:5.2f} s, sustained {s['sustained_per_s']:6.1f} orders/s", flush=True)
                steps[m].append(ladder)
                best[m].append(max(s["sustained_per_s"] for s in ladder))
    med = {m: statistics.median(best[m]) for m in MODES}
    ratio = med["outbox"] / med["plain"]
    print(f"\nsustained orders/s (best step, median of {args.rounds} rounds): outbox {med['outbox']:.1f} "
          f"{best['outbox']}, plain Celery {med['plain']:.1f} {best['plain']}")
    print(f"ratio outbox / plain: {ratio:.2f} (target >= 0.8); effects per order: {per_order} (consumers + e-mail)")
    write_result(args.name, {"broker": args.broker, "rates": rates, "seconds_per_step": args.seconds,
                              "rounds": args.rounds, "clients": args.clients, "effects_per_order": per_order,
                              "worker_conf": args.worker_conf,
                              "worker": "prefork, concurrency 2 (bench._worker, shared by both modes)",
                              "web": "gunicorn -w 2 -k gthread --threads 4",
                              "sustained_per_s": best, "median_sustained_per_s": med,
                              "ratio_outbox_over_plain": round(ratio, 3), "steps": steps})


if __name__ == "__main__":
    main()
