"""Write side: ``place_order`` (order + lines + outbox row, one commit) vs the same order without the
outbox row, on real Postgres. Prints per-order times and the ratio; writes bench/results/write_side.json.

    .venv/bin/python bench/write_side.py [--orders 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import fresh_database, summary_ms, write_result
from celery_outbox.clock import SystemClock
from celery_outbox.db import make_engine, make_session_factory
from celeryconfig import Settings
from chaos.load import order_body
from orders.models import Order, OrderLine
from orders.service import OrderRequest, parse_order, place_order
from relay.factory import create_outbox


def without_outbox(session: object, req: OrderRequest, clock: SystemClock) -> None:
    """The same order write, minus the outbox row: the baseline the outbox costs against."""
    from sqlalchemy.orm import Session

    assert isinstance(session, Session)
    session.add(Order(id=req.order_id, customer_id=req.customer_id, email=req.email, currency=req.currency,
                      total_cents=req.total_cents, status="placed", created_at_ms=clock.now_ms(),
                      lines=[OrderLine(sku=li.sku, quantity=li.quantity, unit_price_cents=li.unit_price_cents)
                             for li in req.lines]))
    session.commit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--orders", type=int, default=2000)
    args = parser.parse_args()
    clock = SystemClock()
    with fresh_database() as url:
        engine = make_engine(url)
        sessions = make_session_factory(engine)
        # Nothing is published here: the memory broker only satisfies the Celery app.
        outbox = create_outbox(Settings(database_url=url), broker_url="memory://", session_factory=sessions,
                               clock=clock)
        reqs = [parse_order(order_body(f"w{i}", index=i)) for i in range(2 * args.orders)]
        timings: dict[str, list[float]] = {"with_outbox": [], "without_outbox": []}
        # Interleave the two so drift (autovacuum, other load) hits both alike.
        for i in range(args.orders):
            for mode, req in (("with_outbox", reqs[2 * i]), ("without_outbox", reqs[2 * i + 1])):
                with sessions() as s:
                    t = time.perf_counter()
                    if mode == "with_outbox":
                        place_order(s, req, outbox=outbox)
                    else:
                        without_outbox(s, req, clock)
                    timings[mode].append(time.perf_counter() - t)
        engine.dispose()
    w, wo = summary_ms(timings["with_outbox"]), summary_ms(timings["without_outbox"])
    ratio = w["mean_ms"] / wo["mean_ms"]
    print(f"place_order with outbox row : mean {w['mean_ms']:.3f} ms  p50 {w['p50_ms']:.3f}  p99 {w['p99_ms']:.3f}")
    print(f"same order without outbox   : mean {wo['mean_ms']:.3f} ms  p50 {wo['p50_ms']:.3f}  p99 {wo['p99_ms']:.3f}")
    print(f"ratio with/without (mean)   : {ratio:.3f}x  (p50 {w['p50_ms'] / wo['p50_ms']:.3f}x)")
    write_result("write_side", {"orders_each": args.orders, "with_outbox": w, "without_outbox": wo,
                                "ratio_mean": round(ratio, 4), "ratio_p50": round(w["p50_ms"] / wo["p50_ms"], 4)})


if __name__ == "__main__":
    main()
