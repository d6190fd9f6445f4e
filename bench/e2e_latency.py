"""End-to-end latency hop by hop: order commit -> relay -> worker -> effect committed, vs plain Celery.

Real processes per broker (an own redis-server with appendfsync always; the shared RabbitMQ under a
namespace of its own): ``outbox relay`` (LISTEN/NOTIFY, DEFAULT settings) and one ``celery worker``
(prefork, ``--concurrency`` processes, 2 by default) of ``bench._worker``, the deployment's app plus a
plain twin of every consumer and of the e-mail task, consuming ``Settings.worker_queues`` but the relay's
(the relay is its own process); ``--worker-conf`` lays Celery settings over the deployment's in the
worker. This script places orders at a fixed rate, interleaving rounds of two modes on the same processes:

- ``outbox``: ``place_order`` (order + OrderPlaced row + the confirmation e-mail task's row, one
  commit); the relay publishes one message per consumer and the task's message, each consumer runs
  inbox + effect in one transaction, the e-mail task calls the provider then commits its inbox row;
- ``plain``: the same order without outbox rows, then after the commit one ``send_task`` (what
  ``.delay()`` does) per consumer and one for the plain e-mail task, to the same queues, running the
  same prepare + handler and the same provider call, no inbox.

The e-mail task is a fourth delivery of each order ("consumer" ``email`` in the figures), keyed by
its task id on the outbox side (its inbox row is ``(task id, task:orders.send_confirmation_email)``).

Timestamps of each delivery (wall clock of this one machine, ms): ``commit`` (this script, right after
the commit), ``published`` (outbox: the row's ``published_at_ms``, set when the relay marks it after the
broker confirmed; plain: right after the last ``send_task`` returned), ``recv`` (worker parent,
``task_received``), ``start`` (pool process, ``task_prerun``), ``inbox`` (outbox only: the inbox row's
``processed_at_ms``), ``done`` (``task_postrun``: the effect is committed; for the e-mail, the provider
call came before the inbox commit, so ``done`` is the task's end). Prints, per broker and
mode, p50/p99 of each checkpoint since commit and of each hop, as the median over rounds of the
per-round figure; the first round of each mode warms up and is dropped. Writes
bench/results/<--name, e2e_latency>.json.

    .venv/bin/python bench/e2e_latency.py [--orders 200] [--rate 20] [--rounds 3] [--brokers redis,rabbitmq]
        [--concurrency 2] [--worker-conf '{"worker_send_task_events": false}'] [--name e2e_latency]
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
from bench._worker import (
    CONF_ENV,
    HOPS_ENV,
    PLAIN_EMAIL,
    place_plain_order,
    plain_celery,
    plain_task_name,
    send_plain,
)
from celery_outbox import Outbox
from celery_outbox.clock import SystemClock
from celery_outbox.inbox.task_keys import task_key
from celery_outbox.messages import task_name
from celeryconfig import Settings
from chaos.environment import CHAOS_ENV, ChaosEnvironment
from chaos.load import order_body
from chaos.processes import ManagedProcess, worker_argv
from consumers.effects import effect_counts
from orders.service import ORDER_PLACED, parse_order, place_order
from orders.tasks import NAME as EMAIL_TASK
from relay.factory import create_outbox

MODES = ("outbox", "plain")
CHECKPOINTS = ("published", "recv", "start", "inbox", "done")
HOPS = (("commit", "published"), ("published", "recv"), ("recv", "start"), ("start", "done"))
EMAIL = "email"  # the confirmation e-mail task, reported as a fourth delivery of each order
EMAIL_HOPS = (("commit", "published"), ("published", "recv"), ("recv", "start"), ("start", "inbox"),
              ("inbox", "done"), ("start", "done"))


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
    """The plain-Celery twin of ``place_order``: the order alone, commit, then one task per consumer and
    the e-mail task."""
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


def expected_deliveries(env: ChaosEnvironment, outbox: Outbox, *, mode: str, marks: dict[str, dict[str, float]]
                        ) -> list[dict[str, Any]]:
    """The deliveries of the round whose message is out: per order, one per consumer and the e-mail task.

    Each is ``{key: (message id, task name) in the hop log, consumer, order, inbox: (message id, inbox
    consumer) or None, commit, published}``. Outbox mode reads the round's rows (published ones only):
    the OrderPlaced row's message id is every consumer's, the e-mail task's row's is its task id.
    """
    consumers = outbox.routes()[ORDER_PLACED]
    out: list[dict[str, Any]] = []
    if mode == "plain":
        for mid, mark in marks.items():
            for c in consumers:
                out.append({**mark, "key": (mid, plain_task_name(c)), "consumer": c, "order": mid, "inbox": None})
            out.append({**mark, "key": (mid, PLAIN_EMAIL), "consumer": EMAIL, "order": mid, "inbox": None})
        return out
    tables = env.tables
    with env.sessions() as s:
        rows = s.execute(sa.select(tables.outbox.message_id, tables.outbox.type, tables.outbox.payload,
                                   tables.outbox.published_at_ms)
                         .where(tables.outbox.published_at_ms.is_not(None))).all()
    for message_id, type_, payload, published in rows:
        mid = str(message_id)
        if type_ == ORDER_PLACED:
            order = str(payload["order_id"])
            if order in marks:
                for c in consumers:
                    out.append({**marks[order], "published": float(published), "key": (mid, task_name(c)),
                                "consumer": c, "order": order, "inbox": (mid, c)})
        elif type_ == EMAIL_TASK:
            order = str(payload["body"][0][0])  # the task's args: (order_id,)
            if order in marks:
                out.append({**marks[order], "published": float(published), "key": (mid, EMAIL_TASK),
                            "consumer": EMAIL, "order": order, "inbox": (mid, task_key(EMAIL_TASK))})
    return out


def collect(env: ChaosEnvironment, outbox: Outbox, hops_dir: Path, *, mode: str,
            marks: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Wait until every delivery of the round (consumers and e-mail) is done; one dict of checkpoint
    times per delivery."""
    expected = len(marks) * (len(outbox.routes()[ORDER_PLACED]) + 1)
    deadline = time.monotonic() + 120
    while True:
        hops = read_hops(hops_dir)
        wanted = expected_deliveries(env, outbox, mode=mode, marks=marks)
        done = [d for d in wanted if "post" in hops.get(d["key"], {})]
        if len(done) >= expected:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(done)}/{expected} deliveries done after 120 s\n{env.logs()}")
        time.sleep(0.3)
    inbox: dict[tuple[str, str], float] = {}
    if mode == "outbox":
        tables = env.tables
        with env.sessions() as s:
            inbox = {(str(m), c): float(t) for m, c, t in s.execute(
                sa.select(tables.inbox.message_id, tables.inbox.consumer, tables.inbox.processed_at_ms)
                .where(tables.inbox.message_id.in_([uuid.UUID(d["key"][0]) for d in done])))}
    out = []
    for d in done:
        h = hops[d["key"]]
        rec: dict[str, Any] = {"commit": d["commit"], "published": d["published"], "recv": h.get("recv", h["pre"]),
                               "start": h["pre"], "done": h["post"], "order": d["order"],
                               "consumer": d["consumer"]}
        if d["inbox"] in inbox:
            rec["inbox"] = inbox[d["inbox"]]
        out.append(rec)
    return out


def round_figures(deliveries: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """p50/p99 of each checkpoint since commit, each hop, commit->done per consumer (the e-mail task
    included), and per order the last delivery's done."""
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
    put("hop start->inbox", (d["inbox"] - d["start"] for d in deliveries if "inbox" in d))
    put("hop inbox->done", (d["done"] - d["inbox"] for d in deliveries if "inbox" in d))
    for c in sorted({d["consumer"] for d in deliveries}):
        put(f"{c}: commit->done", (d["done"] - d["commit"] for d in deliveries if d["consumer"] == c))
    emails = [d for d in deliveries if d["consumer"] == EMAIL]
    for a, b in EMAIL_HOPS:  # the task's own hops; outbox: start->inbox holds the provider call (before_start)
        put(f"{EMAIL}: hop {a}->{b}", (d[b] - d[a] for d in emails if a in d and b in d))
    last: dict[str, float] = {}
    for d in deliveries:
        last[d["order"]] = max(last.get(d["order"], 0.0), d["done"] - d["commit"])
    put("order: commit->all consumers and e-mail done", last.values())
    return figs


def effects(env: ChaosEnvironment) -> dict[str, int]:
    with env.sessions() as s:
        return effect_counts(s)


def check_effects(before: dict[str, int], after: dict[str, int], *, orders: int, what: str) -> None:
    """A task that failed still ends (``task_postrun``): every effect, e-mail included, must be there."""
    short = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0) != orders}
    if short:
        raise RuntimeError(f"{what}: effects committed per kind {short}, expected {orders} each")


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
        # What a worker of the deployment consumes (consumers' queues, the e-mail task's), but the relay's
        # queue: the relay runs as its own process here.
        names = [q for q in env.settings.worker_queues if q != f"{env.namespace}.relay"]
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
                before = effects(env)
                marks = drive(env, outbox, plain, mode=mode, tag=f"{broker}-{mode}-{r}", orders=orders, rate=rate)
                figs = round_figures(collect(env, outbox, hops_dir, mode=mode, marks=marks))
                check_effects(before, effects(env), orders=orders, what=f"{broker} {mode} round {r}")
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
    parser.add_argument("--name", default="e2e_latency", help="bench/results/<name>.json")
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
            print(f"  {key:46s} outbox p50 {o['p50_ms']:7.1f} p99 {o['p99_ms']:7.1f}   {plain}")
        o99 = modes["outbox"]["commit->done"]["p99_ms"]
        p99 = modes["plain"]["commit->done"]["p99_ms"]
        ratio = o99 / max(p99, 0.001)
        summary[broker] = {"outbox_p99_ms": o99, "plain_p99_ms": p99, "ratio_p99": round(ratio, 3),
                           "target_p99_lt_100ms": o99 < 100.0, "target_ratio_le_1_2": ratio <= 1.2}
        print(f"  per delivery commit->done p99: outbox {o99:.1f} ms, plain {p99:.1f} ms, ratio {ratio:.2f}x "
              f"(targets: < 100 ms, <= 1.2x)")
    write_result(args.name, {"orders_per_round": args.orders, "rate_per_s": args.rate, "rounds": args.rounds,
                                 "worker": f"prefork, concurrency {args.concurrency} (bench._worker)",
                                 "worker_conf": args.worker_conf,
                                 "relay": "outbox relay, LISTEN/NOTIFY, default settings",
                                 "redis": "own redis-server, appendfsync always", "summary": summary,
                                 "deliveries_per_order": "every OrderPlaced consumer + the e-mail task",
                                 "results": results})


if __name__ == "__main__":
    main()
