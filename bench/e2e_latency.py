"""End-to-end latency hop by hop: order commit -> relay -> worker -> effect committed, vs plain Celery.

Real processes per broker (an own redis-server with appendfsync always; the shared RabbitMQ under a
namespace of its own): ``outbox relay`` (LISTEN/NOTIFY, DEFAULT settings) and one ``celery worker``
(prefork, ``--concurrency`` processes, 2 by default) of ``bench._worker``, the deployment's app plus a
plain twin of every consumer; ``--worker-conf`` lays Celery settings over the deployment's in the worker.
This script places orders at a fixed rate, interleaving rounds of two modes on the same processes:

- ``outbox``: ``place_order`` (order + outbox row, one commit); the relay publishes one message per
  consumer, each consumer runs inbox + effect in one transaction;
- ``plain``: the same order without the outbox row, then after the commit one ``send_task`` (what
  ``.delay()`` does) per consumer to the same queues, running the same prepare + handler, no inbox.

Timestamps of each delivery (wall clock of this one machine, ms): ``commit`` (this script, right after
the commit), ``published`` (outbox: the row's ``published_at_ms``, set when the relay marks it after the
broker confirmed; plain: right after the last ``send_task`` returned), ``recv`` (worker parent,
``task_received``), ``start`` (pool process, ``task_prerun``), ``inbox`` (outbox only: the inbox row's
``processed_at_ms``), ``done`` (``task_postrun``: the effect is committed). Prints, per broker and
mode, p50/p99 of each checkpoint since commit and of each hop, as the median over rounds of the
per-round figure; the first round of each mode warms up and is dropped. Writes
bench/results/e2e_latency.json.

    .venv/bin/python bench/e2e_latency.py [--orders 200] [--rate 20] [--rounds 3] [--brokers redis,rabbitmq]
        [--concurrency 2] [--worker-conf '{"worker_send_task_events": false}']
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa
from celery import Celery

from bench._common import percentile, write_result
from bench._worker import CONF_ENV, HOPS_ENV, place_plain_order, plain_celery, plain_task_name, send_plain
from celery_outbox import Outbox
from celery_outbox.clock import SystemClock
from celery_outbox.messages import task_name
from celeryconfig import Settings
from chaos.environment import CHAOS_ENV, ChaosEnvironment
from chaos.load import order_body
from chaos.processes import ManagedProcess, worker_argv
from orders.service import ORDER_PLACED, parse_order, place_order
from relay.factory import create_outbox

MODES = ("outbox", "plain")
CHECKPOINTS = ("published", "recv", "start", "inbox", "done")
HOPS = (("commit", "published"), ("published", "recv"), ("recv", "start"), ("start", "done"))


def default_env() -> dict[str, str]:
    """The chaos environment's fast-failure knobs put back to the deployment's defaults: a product run."""
    defaults = {f.name: f.default for f in fields(Settings)}
    out: dict[str, str] = {}
    for key in CHAOS_ENV:
        value = defaults[key.removeprefix("OUTBOX_").lower()]
        out[key] = str(value)
    return out


def read_hops(directory: Path) -> dict[tuple[str, str], dict[str, float]]:
    """(message id, task name) -> {stage: time} from every process's JSON lines, joined on the task id."""
    by_task: dict[str, dict[str, Any]] = {}
    for path in directory.glob("hops-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # a line being written right now
                continue
            stages = by_task.setdefault(rec["id"], {})
            stages.setdefault(rec["k"], float(rec["t"]))
            if rec["k"] == "pre":
                stages["key"] = (rec["mid"], rec["task"])
    return {stages.pop("key"): stages for stages in by_task.values() if "key" in stages}


def place_plain(env: ChaosEnvironment, outbox: Outbox, plain: Celery, order_id: str,
                index: int) -> tuple[str, float, float]:
    """The plain-Celery twin of ``place_order``: the order alone, commit, then one task per consumer."""
    req = parse_order(order_body(order_id, index=index))
    now = outbox.clock.now_ms()
    with env.sessions() as s:
        place_plain_order(s, req, now_ms=now)
    committed = time.time() * 1000.0
    mid = send_plain(plain, outbox.settings, outbox.routes()[ORDER_PLACED], req, now_ms=now)
    return mid, committed, time.time() * 1000.0


def drive(env: ChaosEnvironment, outbox: Outbox, plain: Celery, *, mode: str, tag: str, orders: int,
          rate: float) -> dict[str, dict[str, float]]:
    """Place ``orders`` at ``rate``/s; returns message id -> {commit, published (plain only)}."""
    marks: dict[str, dict[str, float]] = {}
    period = 1.0 / rate
    start = time.perf_counter()
    for i in range(orders):
        delay = start + i * period - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        order_id = f"{tag}-{i}"
        if mode == "outbox":
            with env.sessions() as s:
                place_order(s, parse_order(order_body(order_id, index=i)), outbox=outbox)
            marks[order_id] = {"commit": time.time() * 1000.0}
        else:
            mid, committed, sent = place_plain(env, outbox, plain, order_id, i)
            marks[mid] = {"commit": committed, "published": sent}
    return marks


def collect(env: ChaosEnvironment, outbox: Outbox, hops_dir: Path, *, mode: str,
            marks: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Wait until every delivery of the round is done; one dict of checkpoint times per delivery."""
    consumers = outbox.routes()[ORDER_PLACED]
    names = {c: (task_name(c) if mode == "outbox" else plain_task_name(c)) for c in consumers}
    tables = env.tables
    if mode == "outbox":  # message id -> order id and published_at, from the outbox rows of this round
        def rows() -> list[Any]:
            with env.sessions() as s:
                return [r for r in s.execute(sa.select(tables.outbox.message_id, tables.outbox.payload,
                                                       tables.outbox.published_at_ms)).all()
                        if str(r[1]["order_id"]) in marks]
    expected = len(marks) * len(consumers)
    deadline = time.monotonic() + 120
    while True:
        hops = read_hops(hops_dir)
        by_mid: dict[str, dict[str, float]] = {}
        if mode == "outbox":
            for mid, payload, published in rows():
                if published is not None:
                    by_mid[str(mid)] = {**marks[str(payload["order_id"])], "published": float(published)}
        else:
            by_mid = marks
        done = [(mid, c) for mid in by_mid for c in consumers if "post" in hops.get((mid, names[c]), {})]
        if len(done) >= expected:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(done)}/{expected} deliveries done after 120 s\n{env.logs()}")
        time.sleep(0.3)
    inbox: dict[tuple[str, str], float] = {}
    if mode == "outbox":
        with env.sessions() as s:
            inbox = {(str(m), c): float(t) for m, c, t in s.execute(
                sa.select(tables.inbox.message_id, tables.inbox.consumer, tables.inbox.processed_at_ms)
                .where(tables.inbox.message_id.in_([uuid.UUID(m) for m in by_mid])))}
    out = []
    for mid, c in done:
        h = hops[(mid, names[c])]
        rec: dict[str, Any] = {**by_mid[mid], "recv": h.get("recv", h["pre"]), "start": h["pre"], "done": h["post"],
               "mid": mid, "consumer": c}
        if (mid, c) in inbox:
            rec["inbox"] = inbox[(mid, c)]
        out.append(rec)
    return out


def round_figures(deliveries: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """p50/p99 of each checkpoint since commit, each hop, and per order the last consumer's done."""
    figs: dict[str, dict[str, float]] = {}

    def put(name: str, values: Iterable[float]) -> None:
        vals = list(values)
        if vals:
            figs[name] = {"n": len(vals), "p50_ms": round(percentile(vals, 50), 2),
                          "p99_ms": round(percentile(vals, 99), 2)}

    for cp in CHECKPOINTS:
        put(f"commit->{cp}", (d[cp] - d["commit"] for d in deliveries if cp in d))
    for a, b in HOPS:
        put(f"hop {a}->{b}", (d[b] - d[a] for d in deliveries))
    last: dict[str, float] = {}
    for d in deliveries:
        last[d["mid"]] = max(last.get(d["mid"], 0.0), d["done"] - d["commit"])
    put("order: commit->all consumers done", last.values())
    return figs


def median_of_rounds(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for key in rounds[0]:
        per = [r[key] for r in rounds if key in r]
        out[key] = {"p50_ms": round(statistics.median(p["p50_ms"] for p in per), 2),
                    "p99_ms": round(statistics.median(p["p99_ms"] for p in per), 2),
                    "rounds_p99_ms": [p["p99_ms"] for p in per]}  # type: ignore[dict-item]
    return out


def run_broker(broker: str, *, orders: int, rate: float, rounds: int, worker_conf: str = "",
               concurrency: int = 2) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"outbox-e2e-{broker}-"))
    hops_dir = work / "hops"
    hops_dir.mkdir()
    with ChaosEnvironment(broker=broker, workdir=work, extra_env={**default_env(), HOPS_ENV: str(hops_dir),
                                                                             CONF_ENV: worker_conf}) as env:
        env.relay().start()
        names = [env.settings.queue_name(c) for c in env.consumers]
        worker = env.processes.add(ManagedProcess(
            name="worker", env=env.env, log_dir=work / "logs", cwd=Path(__file__).resolve().parent.parent,
            argv=worker_argv(queues=names, pool="prefork", concurrency=concurrency, app="bench._worker",
                             hostname=f"e2e-{env.namespace}")))
        worker.start()
        env.wait(lambda: "ready" in worker.log_path.read_text(errors="replace"), what="worker ready")
        outbox = create_outbox(env.settings, session_factory=env.sessions, clock=SystemClock())
        plain = plain_celery(outbox.settings)
        per_mode: dict[str, list[dict[str, dict[str, float]]]] = {m: [] for m in MODES}
        for r in range(rounds + 1):  # round 0 warms up every process and connection; dropped
            for mode in MODES:
                marks = drive(env, outbox, plain, mode=mode, tag=f"{broker}-{mode}-{r}", orders=orders, rate=rate)
                figs = round_figures(collect(env, outbox, hops_dir, mode=mode, marks=marks))
                if r:
                    per_mode[mode].append(figs)
                line = " | ".join(f"{k.removeprefix('commit->')} {figs[k]['p50_ms']:.0f}/{figs[k]['p99_ms']:.0f}"
                                  for k in ("commit->published", "commit->recv", "commit->done") if k in figs)
                print(f"  {broker:8s} round {r}{' (warm-up)' if not r else ''} {mode:6s} "
                      f"ms since commit p50/p99: {line}", flush=True)
    return {m: median_of_rounds(per_mode[m]) for m in MODES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--orders", type=int, default=200, help="orders per round and mode")
    parser.add_argument("--rate", type=float, default=20.0, help="orders per second")
    parser.add_argument("--concurrency", type=int, default=2, help="worker processes (prefork)")
    parser.add_argument("--worker-conf", default="",
                        help="JSON Celery settings laid over the deployment's in the worker (a knob experiment)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per mode (after one warm-up)")
    parser.add_argument("--brokers", default="redis,rabbitmq")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for broker in args.brokers.split(","):
        results[broker] = run_broker(broker, orders=args.orders, rate=args.rate, rounds=args.rounds,
                                     worker_conf=args.worker_conf, concurrency=args.concurrency)
    summary: dict[str, Any] = {}
    for broker, modes in results.items():
        print(f"\n{broker}: {args.orders} orders/round at {args.rate:g}/s, median of {args.rounds} rounds (ms)")
        for key in modes["outbox"]:
            o = modes["outbox"][key]
            p = modes["plain"].get(key)
            plain = f"plain p50 {p['p50_ms']:7.1f} p99 {p['p99_ms']:7.1f}" if p else ""
            print(f"  {key:36s} outbox p50 {o['p50_ms']:7.1f} p99 {o['p99_ms']:7.1f}   {plain}")
        o99 = modes["outbox"]["commit->done"]["p99_ms"]
        p99 = modes["plain"]["commit->done"]["p99_ms"]
        ratio = o99 / max(p99, 0.001)
        summary[broker] = {"outbox_p99_ms": o99, "plain_p99_ms": p99, "ratio_p99": round(ratio, 3),
                           "target_p99_lt_100ms": o99 < 100.0, "target_ratio_le_1_2": ratio <= 1.2}
        print(f"  per delivery commit->done p99: outbox {o99:.1f} ms, plain {p99:.1f} ms, ratio {ratio:.2f}x "
              f"(targets: < 100 ms, <= 1.2x)")
    write_result("e2e_latency", {"orders_per_round": args.orders, "rate_per_s": args.rate, "rounds": args.rounds,
                                 "worker": f"prefork, concurrency {args.concurrency} (bench._worker)",
                                 "worker_conf": args.worker_conf,
                                 "relay": "outbox relay, LISTEN/NOTIFY, default settings",
                                 "redis": "own redis-server, appendfsync always", "summary": summary,
                                 "results": results})


if __name__ == "__main__":
    main()
