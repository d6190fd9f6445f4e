"""End-to-end latency: order commit -> effect, at a fixed order rate, LISTEN/NOTIFY vs polling.

Real processes: an own redis-server (appendfsync always), ``outbox relay`` (with LISTEN, or
``--no-listen`` polling at the default 1 s interval), one ``celery worker`` (threads, 2), real
Postgres. Orders are placed by this script at a fixed rate with ``place_order``. Latency per order is
``inbox.processed_at_ms - orders.created_at_ms`` (the consumer's clock reading when it handled the
delivery; its commit follows within a few ms), for shipping and for the last of the four consumers.
Writes bench/results/e2e_latency.json.

    .venv/bin/python bench/e2e_latency.py [--orders 200] [--rate 20]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

from bench._common import percentile, write_result
from celery_outbox.clock import SystemClock
from chaos import invariants
from chaos.environment import ChaosEnvironment
from chaos.load import order_body
from orders.models import Order
from orders.service import parse_order, place_order
from relay.factory import create_outbox


def stats(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": percentile(values, 50), "p95_ms": percentile(values, 95),
            "p99_ms": percentile(values, 99), "max_ms": max(values) if values else float("nan")}


def run(mode: str, *, orders: int, rate: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"outbox-e2e-{mode}-"))
    # The product default poll interval (Settings.relay_poll_interval_s = 1.0), not the chaos one.
    with ChaosEnvironment(broker="redis", workdir=work, extra_env={"OUTBOX_RELAY_POLL_INTERVAL_S": "1.0",
                                                                  "OUTBOX_RELAY_BATCH_SIZE": "100"}) as env:
        env.relay(args=["--no-listen"] if mode == "polling" else []).start()
        worker = env.worker()
        worker.start()
        env.wait(lambda: "ready" in worker.log_path.read_text(errors="replace"), what="worker ready")
        time.sleep(1.0)
        outbox = create_outbox(env.settings, session_factory=env.sessions, clock=SystemClock())
        tables = env.tables
        period = 1.0 / rate
        start = time.perf_counter()
        for i in range(orders):
            delay = start + i * period - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            with env.sessions() as s:
                place_order(s, parse_order(order_body(f"{mode}-{i}", index=i)), outbox=outbox)
        with env.sessions() as s:
            env.wait(lambda: invariants.quiescent(s, tables=tables, consumers=env.consumers, expected_dead_letters=0),
                     timeout_s=120, what="every effect")
            created = dict(s.execute(sa.select(Order.id, Order.created_at_ms)).all())
            mid_to_order = {m: str(p["order_id"]) for m, p in
                            s.execute(sa.select(tables.outbox.message_id, tables.outbox.payload)).all()}
            shipping: list[float] = []
            last: dict[str, int] = {}
            for mid, consumer, at in s.execute(sa.select(tables.inbox.message_id, tables.inbox.consumer,
                                                         tables.inbox.processed_at_ms)).all():
                order = mid_to_order[mid]
                if consumer == "shipping":
                    shipping.append(float(at - created[order]))
                last[order] = max(last.get(order, 0), at)
            all_four = [float(at - created[o]) for o, at in last.items()]
    return {"mode": mode, "shipping": stats(shipping), "all_consumers": stats(all_four)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--orders", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0, help="orders per second")
    args = parser.parse_args()
    results = {mode: run(mode, orders=args.orders, rate=args.rate) for mode in ("listen_notify", "polling")}
    for mode, r in results.items():
        sh, al = r["shipping"], r["all_consumers"]
        print(f"{mode:14s} shipping p50 {sh['p50_ms']:.0f} ms p95 {sh['p95_ms']:.0f} p99 {sh['p99_ms']:.0f} | "
              f"all four p50 {al['p50_ms']:.0f} p95 {al['p95_ms']:.0f} p99 {al['p99_ms']:.0f}")
    ratio = results["polling"]["shipping"]["p50_ms"] / max(results["listen_notify"]["shipping"]["p50_ms"], 1.0)
    print(f"ratio polling / LISTEN-NOTIFY (shipping p50): {ratio:.2f}x")
    write_result("e2e_latency", {"orders": args.orders, "rate_per_s": args.rate,
                                 "broker": "redis (own, appendfsync always)",
                                 "relay_poll_interval_s": 1.0, "results": results,
                                 "ratio_polling_over_notify_p50": round(ratio, 3)})


if __name__ == "__main__":
    main()
