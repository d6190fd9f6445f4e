"""Transactional enqueue: ``task.delay()`` inside ``outbox.transaction(session)`` (an outbox row in the
caller's commit) against a direct ``delay()`` after the commit (today's Celery pattern), each with the
same business row and commit, on real Postgres and a real broker. Prints per-call times and the ratio
against the direct publish (the ceiling, measured in the same run, interleaved); writes
bench/results/enqueue_cost.json. Nothing asserts on speed.

    .venv/bin/python bench/enqueue_cost.py [--calls 1000] [--rounds 3] [--broker redis://127.0.0.1:6379/11]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import sessionmaker

from bench._common import fresh_database, summary_ms, write_result
from celery_outbox import Outbox, Settings, make_engine

ITEMS = sa.Table("bench_items", sa.MetaData(), sa.Column("id", sa.String(64), primary_key=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/11")
    args = parser.parse_args()
    with fresh_database("outbox_bench_enqueue") as url:
        engine = make_engine(url)
        ITEMS.create(engine)
        sessions = sessionmaker(engine)
        app = Celery("bench", broker=args.broker, set_as_current=False)
        namespace = f"bench{uuid.uuid4().hex[:6]}"
        app.conf.task_default_queue = f"{namespace}.tasks"
        outbox = Outbox(app, engine=engine, settings=Settings(namespace=namespace, enqueue_outside_transaction="publish"))

        @app.task(name="bench.noop")  # type: ignore[untyped-decorator]
        def noop(i: int) -> None: ...

        def direct() -> float:
            start = time.perf_counter()
            with sessions.begin() as s:
                s.execute(ITEMS.insert().values(id=uuid.uuid4().hex))
            noop.delay(1)  # after the commit: the usual pattern, outside any transaction
            return time.perf_counter() - start

        def through_outbox() -> float:
            start = time.perf_counter()
            with sessions.begin() as s, outbox.transaction(s):
                s.execute(ITEMS.insert().values(id=uuid.uuid4().hex))
                noop.delay(1)  # an outbox row in the same commit
            return time.perf_counter() - start

        for fn in (direct, through_outbox):  # warm up connections and caches
            for _ in range(50):
                fn()
        samples: dict[str, list[float]] = {"direct": [], "outbox": []}
        ratios = []
        for _ in range(args.rounds):  # interleaved rounds
            d = [direct() for _ in range(args.calls)]
            o = [through_outbox() for _ in range(args.calls)]
            samples["direct"] += d
            samples["outbox"] += o
            ratios.append(statistics.median(o) / statistics.median(d))
        result = {"calls": args.calls, "rounds": args.rounds, "broker": args.broker.split("@")[-1],
                  "direct_delay_after_commit": summary_ms(samples["direct"]),
                  "delay_inside_outbox_transaction": summary_ms(samples["outbox"]),
                  "ratio_outbox_to_direct_per_round": [round(r, 3) for r in ratios],
                  "ratio_median": round(statistics.median(ratios), 3)}
        print(f"direct delay after commit   p50 {result['direct_delay_after_commit']['p50_ms']:.3f} ms")
        print(f"delay inside the outbox tx  p50 {result['delay_inside_outbox_transaction']['p50_ms']:.3f} ms")
        print(f"ratio (outbox / direct), median of {args.rounds} interleaved rounds: {result['ratio_median']}")
        write_result("enqueue_cost", result)
        app.close()
        engine.dispose()


if __name__ == "__main__":
    main()
