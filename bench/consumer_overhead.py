"""Consumer overhead: the inbox (claim row + effect in ONE transaction) vs the effect alone.

Same process, same Postgres, same shipping handler, same kind of envelope; only the inbox differs.
Each round interleaves, delivery by delivery: the effect alone (Shipment insert + commit), the inbox +
the effect (``inbox.handle``), a duplicate of that message (what a redelivery costs), and the whole
first-delivery core a worker runs (``delivery.deliver`` on the envelope as JSON text, as the task
receives it). Prints per-round means, the median of the rounds and the ratio inbox / effect alone;
writes bench/results/consumer_overhead.json.

    .venv/bin/python bench/consumer_overhead.py [--deliveries 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import fresh_database, summary_ms, write_result
from celery_outbox.clock import SystemClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.delivery import deliver
from celery_outbox.inbox.claim import NOW_KEY
from celery_outbox.inbox.handle import handle
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import define_tables
from celery_outbox.settings import Settings
from chaos.load import order_body
from consumers.shipping import shipping
from orders.service import order_placed_payload, parse_order

KINDS = ("effect_alone", "inbox_and_effect", "duplicate", "deliver_first")


def envelope(i: int) -> Envelope:
    req = parse_order(order_body(f"c{i}", index=i))
    return Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload=order_placed_payload(req),
                    headers={"entity_key": f"order:c{i}", "entity_version": 1}, created_at_ms=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deliveries", type=int, default=1000, help="deliveries of each kind per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    clock = SystemClock()
    tables = define_tables()
    settings = Settings()
    n = args.deliveries
    rounds: list[dict[str, dict[str, float]]] = []
    with fresh_database() as url:
        engine = make_engine(url)
        sessions = make_session_factory(engine)
        for r in range(args.rounds + 1):  # round 0 warms up (connections, statement caches) and is dropped
            envs = [envelope(i) for i in range(3 * n)]
            texts = [json.dumps(e.to_dict()) for e in envs[2::3]]
            times: dict[str, list[float]] = {k: [] for k in KINDS}
            for i in range(n):
                with sessions() as s:
                    t = time.perf_counter()
                    s.info[NOW_KEY] = clock.now_ms()
                    shipping.handler(s, envs[3 * i])
                    s.commit()
                    times["effect_alone"].append(time.perf_counter() - t)
                with sessions() as s:
                    t = time.perf_counter()
                    out = handle(s, envs[3 * i + 1], tables=tables, consumer="shipping", handler=shipping.handler,
                                 clock=clock)
                    times["inbox_and_effect"].append(time.perf_counter() - t)
                    assert out is Outcome.PROCESSED
                with sessions() as s:
                    t = time.perf_counter()
                    out = handle(s, envs[3 * i + 1], tables=tables, consumer="shipping", handler=shipping.handler,
                                 clock=clock)
                    times["duplicate"].append(time.perf_counter() - t)
                    assert out is Outcome.DUPLICATE
                t = time.perf_counter()
                result = deliver(sessions, shipping, texts[i], tables=tables, request_id=None, settings=settings,
                                 clock=clock, first_delivery=True)
                times["deliver_first"].append(time.perf_counter() - t)
                assert result.outcome is Outcome.PROCESSED, result
            if r:
                summary = {k: summary_ms(v) for k, v in times.items()}
                rounds.append(summary)
                print(f"round {r}: " + "  ".join(f"{k} {summary[k]['mean_ms']:.3f}" for k in KINDS)
                      + f"  ratio {summary['inbox_and_effect']['mean_ms'] / summary['effect_alone']['mean_ms']:.3f}x")
        engine.dispose()
    med = {k: {m: statistics.median(rd[k][m] for rd in rounds) for m in ("mean_ms", "p50_ms", "p99_ms")}
           for k in KINDS}
    ratios = [rd["inbox_and_effect"]["mean_ms"] / rd["effect_alone"]["mean_ms"] for rd in rounds]
    deliver_ratios = [rd["deliver_first"]["mean_ms"] / rd["effect_alone"]["mean_ms"] for rd in rounds]
    ratio, deliver_ratio = statistics.median(ratios), statistics.median(deliver_ratios)
    print(f"\nmedian of {len(rounds)} interleaved rounds of {n} deliveries each (ms per delivery):")
    print(f"effect alone (shipment insert + commit): mean {med['effect_alone']['mean_ms']:.3f}  "
          f"p50 {med['effect_alone']['p50_ms']:.3f}")
    print(f"inbox + effect, one transaction       : mean {med['inbox_and_effect']['mean_ms']:.3f}  "
          f"p50 {med['inbox_and_effect']['p50_ms']:.3f}")
    print(f"duplicate delivery (absorbed)         : mean {med['duplicate']['mean_ms']:.3f}  "
          f"p50 {med['duplicate']['p50_ms']:.3f}")
    print(f"deliver() first delivery, JSON text   : mean {med['deliver_first']['mean_ms']:.3f}  "
          f"p50 {med['deliver_first']['p50_ms']:.3f}")
    print(f"ratio inbox+effect / effect alone (median of round means): {ratio:.3f}x  (target <= 1.3x)")
    print(f"ratio deliver() / effect alone (median of round means)   : {deliver_ratio:.3f}x")
    write_result("consumer_overhead", {"deliveries_each": n, "rounds": len(rounds), "median": med,
                                       "ratio_inbox_mean": round(ratio, 4), "ratios_per_round": ratios,
                                       "ratio_deliver_mean": round(deliver_ratio, 4),
                                       "deliver_ratios_per_round": deliver_ratios, "rounds_detail": rounds})


if __name__ == "__main__":
    main()
