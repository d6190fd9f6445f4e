"""Consumer overhead: the inbox (claim row + effect in ONE transaction) vs the effect alone.

Same process, same Postgres, same shipping handler, same envelopes; only the inbox differs. Prints per
delivery times and the ratio; writes bench/results/consumer_overhead.json. Also times a duplicate
delivery (the fast path's read) since that is what a redelivery costs.

    .venv/bin/python bench/consumer_overhead.py [--deliveries 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import fresh_database, summary_ms, write_result
from celery_outbox.clock import SystemClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.inbox.handle import NOW_KEY, handle
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import define_tables
from chaos.load import order_body
from consumers.shipping import shipping
from orders.service import order_placed_payload, parse_order


def envelope(i: int) -> Envelope:
    req = parse_order(order_body(f"c{i}", index=i))
    return Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload=order_placed_payload(req),
                    headers={"entity_key": f"order:c{i}", "entity_version": 1}, created_at_ms=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deliveries", type=int, default=2000)
    args = parser.parse_args()
    clock = SystemClock()
    tables = define_tables()
    n = args.deliveries
    with fresh_database() as url:
        engine = make_engine(url)
        sessions = make_session_factory(engine)
        envs = [envelope(i) for i in range(2 * n)]
        times: dict[str, list[float]] = {"effect_alone": [], "inbox_and_effect": [], "duplicate": []}
        for i in range(n):
            with sessions() as s:
                t = time.perf_counter()
                s.info[NOW_KEY] = clock.now_ms()
                shipping.handler(s, envs[2 * i])
                s.commit()
                times["effect_alone"].append(time.perf_counter() - t)
            with sessions() as s:
                t = time.perf_counter()
                out = handle(s, envs[2 * i + 1], tables=tables, consumer="shipping", handler=shipping.handler, clock=clock)
                times["inbox_and_effect"].append(time.perf_counter() - t)
                assert out is Outcome.PROCESSED
            with sessions() as s:
                t = time.perf_counter()
                out = handle(s, envs[2 * i + 1], tables=tables, consumer="shipping", handler=shipping.handler, clock=clock)
                times["duplicate"].append(time.perf_counter() - t)
                assert out is Outcome.DUPLICATE
        engine.dispose()
    a, b, d = (summary_ms(times[k]) for k in ("effect_alone", "inbox_and_effect", "duplicate"))
    ratio = b["mean_ms"] / a["mean_ms"]
    print(f"effect alone (shipment insert + commit): mean {a['mean_ms']:.3f} ms  p50 {a['p50_ms']:.3f}")
    print(f"inbox + effect, one transaction       : mean {b['mean_ms']:.3f} ms  p50 {b['p50_ms']:.3f}")
    print(f"duplicate delivery (absorbed)         : mean {d['mean_ms']:.3f} ms  p50 {d['p50_ms']:.3f}")
    print(f"ratio inbox+effect / effect alone (mean): {ratio:.3f}x  (p50 {b['p50_ms'] / a['p50_ms']:.3f}x)")
    write_result("consumer_overhead", {"deliveries_each": n, "effect_alone": a, "inbox_and_effect": b,
                                       "duplicate": d, "ratio_mean": round(ratio, 4),
                                       "ratio_p50": round(b["p50_ms"] / a["p50_ms"], 4)})


if __name__ == "__main__":
    main()
