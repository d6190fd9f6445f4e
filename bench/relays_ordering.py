"""Per-entity ordering under 1, 2 and 4 relay processes (chaos/ordering_run.py), with real workers.

For each relay count (``--relays 1,2,4``) and round (``--repeat``): a fresh database and namespace on
the shared RabbitMQ, N ``outbox relay`` processes and ``--workers`` ``celery worker`` processes
(``--pool``, ``--concurrency``) on the ``ordering=True`` search consumer, at the library's default
settings; the writer commits ``--orders`` x ``--versions`` events (version 1, then 2..N of each
order, interleaved over ``--window`` open orders) at ``--rate`` commits/s. Prints and writes, per run:
versions applied out of order (must be 0), stale versions skipped, versions parked and released,
park latency p50/p99/max, versions published before their predecessor, duplicates absorbed, dead
letters. Writes bench/results/relays_ordering.json; exit 1 if any run broke per-entity order.

    flock /tmp/bench.lock .venv/bin/python bench/relays_ordering.py [--orders 400] [--versions 5] [--repeat 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_result
from chaos.ordering_run import run_ordering

SHOWN = ("applied", "applied_out_of_order", "stale_skipped", "parked", "released", "park_ms_p50", "park_ms_p99",
         "park_ms_max", "published_before_predecessor", "duplicates_absorbed", "dead_letters", "write_s", "drain_s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--relays", default="1,2,4")
    ap.add_argument("--orders", type=int, default=400)
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--rate", type=float, default=100.0, help="writer commits per second (one event each)")
    ap.add_argument("--window", type=int, default=20, help="orders open at once (their versions interleave)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--pool", default="threads", choices=("threads", "prefork"))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--name", default="relays_ordering")
    args = ap.parse_args(argv)
    counts = [int(n) for n in args.relays.split(",")]
    runs: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="outbox-relays-ordering-"))
    for rnd in range(args.repeat):
        for n in counts:
            report = run_ordering(relays=n, orders=args.orders, versions=args.versions, rate=args.rate,
                                  window=args.window, workers=args.workers, concurrency=args.concurrency,
                                  pool=args.pool, seed=rnd + 1, workdir=work / f"r{rnd}-n{n}", progress=print)
            data = report.as_json()
            runs.append({"round": rnd + 1, **data})
            print(f"round {rnd + 1}, {n} relays: " + ", ".join(f"{k}={data[k]}" for k in SHOWN)
                  + ("" if report.ok else f"  NOT OK: {report.violations}"), flush=True)
    summary: dict[str, Any] = {}
    for n in counts:
        mine = [r for r in runs if r["relays"] == n]
        summary[str(n)] = {
            "applied_out_of_order": sum(r["applied_out_of_order"] for r in mine),
            "stale_skipped": sum(r["stale_skipped"] for r in mine),
            "parked_per_run": [r["parked"] for r in mine],
            "released_per_run": [r["released"] for r in mine],
            "park_ms_max": max((r["park_ms_max"] or 0.0) for r in mine),
            "park_ms_p99_median": statistics.median([r["park_ms_p99"] or 0.0 for r in mine]),
            "published_before_predecessor_per_run": [r["published_before_predecessor"] for r in mine],
            "duplicates_absorbed": sum(r["duplicates_absorbed"] for r in mine),
            "dead_letters": sum(r["dead_letters"] for r in mine),
            "all_ok": all(r["ok"] for r in mine),
        }
        print(f"{n} relays: {summary[str(n)]}")
    write_result(args.name, {"args": vars(args), "runs": runs, "summary": summary})
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
