"""CPU per delivery of a prefork worker's PARENT process, outbox consumer vs plain Celery, on a real backlog.

bench/worker_parent.py times the outbox's pieces in one process; this measures the whole parent: a real
``celery worker -A relay.app`` (the deployment's app and configuration, the ``shipping`` consumer with its
strategy, receipts hook, prefetch, late acks) and a real ``celery worker -A bench._plain_worker`` (Celery's
default configuration, the same consumer's ``prepare`` + handler as a plain task), both ``-P prefork -c N
--loglevel WARNING --without-gossip --without-mingle --without-heartbeat`` (bench/sweep.py's flags). Per round
and mode, ``--messages`` messages are published onto the worker's queue at once (a backlog: the parent
works flat out), and the parent's utime + stime (``/proc/<pid>/stat``) is read before the first publish and
after the last effect (a ``shipments`` row per message); the pool processes are read too. The two modes
alternate, and the first round of each is a warm-up (not reported). Every process talks to RabbitMQ and
Postgres directly.

With ``--rate`` the messages are published one by one at that rate instead (the parent wakes up per
message, as at a commit rate the pipeline keeps up with).

    .venv/bin/python bench/parent_cpu.py [--messages 1000] [--rounds 4] [--concurrency 2] [--rate 0]
        [--profile PATH]   # py-spy each parent during its last round (raw stacks; needs py-spy)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

from bench._common import write_result
from bench.consumer_cpu import children_of, cpu_ticks
from bench.sweep import DirectRabbit

CONSUMER = "shipping"
TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def pace(t0: float, i: int, rate: float) -> None:
    """Sleep until message ``i`` is due (open loop, ``rate`` per second; 0: no pacing)."""
    if rate:
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def shipments(env: Any) -> int:
    from consumers.models import Shipment

    return int(env.scalar(sa.select(sa.func.count()).select_from(Shipment)))


def main() -> None:
    from bench._plain_worker import TASK_PREFIX, plain_client
    from bench._worker import envelope_dict
    from bench.e2e_latency import default_env
    from celery_outbox.celery.kombu_publisher import KombuPublisher
    from chaos.environment import ChaosEnvironment
    from chaos.processes import BIN, ManagedProcess, worker_argv
    from consumers.testing import order_placed_envelope

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per mode, the first a warm-up (default 4)")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--rate", type=float, default=0.0,
                        help="messages/s, published one by one (default 0: all at once, a backlog)")
    parser.add_argument("--profile", default="", help="py-spy raw stacks of each parent's last round: PATH.outbox, PATH.plain")
    parser.add_argument("--name", default="parent_cpu")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="outbox-parent-cpu-"))
    (work / "logs").mkdir()
    env = ChaosEnvironment(broker="rabbitmq", workdir=work, extra_env=default_env())
    env.broker = DirectRabbit()
    plain_queue = f"{env.namespace}.plain.{CONSUMER}"
    flags = ["-P", "prefork", "-c", str(args.concurrency)]
    results: dict[str, list[dict[str, float]]] = {"outbox": [], "plain": []}
    with env:
        queue = env.settings.queue_name(CONSUMER)
        outbox_argv = worker_argv(queues=[queue], pool="prefork", concurrency=args.concurrency,
                                  hostname=f"parent-outbox-{env.namespace}")
        outbox_argv[outbox_argv.index("--loglevel") + 1] = "WARNING"
        plain_argv = [str(BIN / "celery"), "-A", "bench._plain_worker", "worker", "-Q", plain_queue, *flags,
                      "--without-gossip", "--without-mingle", "--without-heartbeat",
                      "-n", f"parent-plain-{env.namespace}@%h", "--loglevel", "WARNING"]
        workers = {mode: env.processes.add(ManagedProcess(name=f"worker-{mode}", argv=argv, env=env.env,
                                                          log_dir=work / "logs", cwd=Path(__file__).parent.parent))
                   for mode, argv in (("outbox", outbox_argv), ("plain", plain_argv))}
        client = plain_client(env.broker.url, confirm_publish=False)
        publisher = KombuPublisher(broker_url=env.broker.url, settings=env.settings)
        for w in workers.values():
            w.start()
        time.sleep(8)  # imports, pool forks, consumers up
        for r in range(args.rounds):
            for mode in ("outbox", "plain") if r % 2 == 0 else ("plain", "outbox"):
                n = args.messages
                envelopes = [order_placed_envelope(f"p-{uuid.uuid4().hex[:12]}") for _ in range(n)]
                before_effects = shipments(env)
                pid = workers[mode].pid
                assert pid is not None
                pool = children_of(pid)
                parent0, pool0 = cpu_ticks(pid), sum(cpu_ticks(p) for p in pool)
                spy = None
                if args.profile and r == args.rounds - 1:
                    spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--nonblocking",
                                            "-p", str(pid), "-r", "250", "--format", "raw",
                                            "-o", f"{args.profile}.{mode}"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(1.0)
                t0 = time.monotonic()
                if mode == "outbox":
                    messages = [env.task_message(e, CONSUMER) for e in envelopes]
                    if not args.rate:
                        publisher.publish_batch(messages)
                    for i, one in enumerate(messages if args.rate else []):
                        pace(t0, i, args.rate)
                        publisher.publish_batch([one])
                else:
                    for i, e in enumerate(envelopes):
                        pace(t0, i, args.rate)
                        client.send_task(f"{TASK_PREFIX}{CONSUMER}", queue=plain_queue, args=[envelope_dict(
                            message_id=e.message_id, payload=e.payload, entity_key=str(e.headers["entity_key"]),
                            created_at_ms=e.created_at_ms)])
                deadline = time.monotonic() + 600
                while shipments(env) < before_effects + n:
                    if time.monotonic() > deadline or not workers[mode].alive():
                        raise RuntimeError(f"{mode}: deliveries did not finish\n{env.logs()}")
                    time.sleep(0.1)
                wall = time.monotonic() - t0
                parent = (cpu_ticks(pid) - parent0) * TICK_MS / n
                pool_ms = (sum(cpu_ticks(p) for p in pool) - pool0) * TICK_MS / n
                if spy is not None:
                    spy.send_signal(2)
                    spy.wait(timeout=60)
                row = {"parent_ms": parent, "pool_ms": pool_ms, "per_s": n / wall}
                print(f"round {r} {mode:6} parent {parent:.3f} ms/delivery  pool {pool_ms:.3f}  "
                      f"{n / wall:.0f} deliveries/s", flush=True)
                if r:
                    results[mode].append(row)
        publisher.close()
    med = {mode: {k: statistics.median(row[k] for row in rows) for k in rows[0]} for mode, rows in results.items()}
    print(f"\nmedian of {args.rounds - 1} warmed rounds, {args.messages} messages each, -c {args.concurrency}:")
    for mode, m in med.items():
        print(f"  {mode:6} parent {m['parent_ms']:.3f} ms/delivery, pool {m['pool_ms']:.3f}, {m['per_s']:.0f}/s")
    print(f"  parent outbox / plain: {med['outbox']['parent_ms'] / med['plain']['parent_ms']:.2f}x "
          f"(+{med['outbox']['parent_ms'] - med['plain']['parent_ms']:.3f} ms per delivery)")
    write_result(args.name, {"messages": args.messages, "concurrency": args.concurrency, "median": med,
                             "rounds": results})


if __name__ == "__main__":
    main()
