"""Failovers at bench size (chaos/failover_run.py): a Postgres primary killed and its standby promoted
(asynchronous and synchronous replication), and a Redis primary behind Sentinel killed with a worker.

Starts its own engines (chaos/pg_pair.py from Debian's PostgreSQL 15 binaries, chaos/sentinel.py from
redis-server), runs ``--orders`` orders through the reference deployment's order writer, relay and two
workers for each, and prints/writes per engine: orders, faults, lost, doubled, lost commits, ghost
effects, re-sent by the reconciler, time to recover (promotion, writer, relay, workers), commit ->
shipment latency before the fault and over the whole run. Writes bench/results/failover.json.

    .venv/bin/python bench/failover.py [--orders 1000] [--writer-s 60] [--only pg-async,pg-sync,sentinel]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_result
from chaos.failover_run import FailoverReport, run_pg_failover, run_sentinel_failover
from chaos.pg_pair import PgPair, postgres_missing
from chaos.sentinel import SentinelGroup, sentinel_missing

RUNS = ("pg-async", "pg-sync", "sentinel")
SHOWN = ("orders", "committed_seen", "present", "lost_commits", "lost_in_window", "orphans", "lost", "doubled",
         "ghost_effects", "ghost_dead_letters", "published_in_window", "resent", "duplicates_absorbed",
         "writer_errors", "recovery", "latency_ms", "quiesced", "duration_s", "ok")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=1000)
    parser.add_argument("--writer-s", type=float, default=60.0, help="seconds over which the orders are placed")
    parser.add_argument("--only", default=",".join(RUNS))
    parser.add_argument("--name", default="failover")
    args = parser.parse_args(argv)
    runs = [r for r in args.only.split(",") if r]
    unknown = set(runs) - set(RUNS)
    if unknown:
        print(f"--only: unknown run(s) {', '.join(sorted(unknown))}; choose from {', '.join(RUNS)}", file=sys.stderr)
        return 2
    for reason in (postgres_missing() if any(r.startswith("pg") for r in runs) else None,
                   sentinel_missing() if "sentinel" in runs else None):
        if reason:
            print(reason, file=sys.stderr)
            return 2
    work = Path(tempfile.mkdtemp(prefix="outbox-failover-"))
    results: dict[str, Any] = {"orders": args.orders, "writer_s": args.writer_s}
    ok = True
    for run in runs:
        print(f"== {run}")
        report: FailoverReport
        if run == "sentinel":
            with SentinelGroup() as group:
                report = run_sentinel_failover(group=group, orders=args.orders, workdir=work / run,
                                               writer_s=args.writer_s, timeout_s=600, progress=print)
                setup = group.timings
        else:
            with PgPair() as pair:
                report = run_pg_failover(pair=pair, orders=args.orders, workdir=work / run,
                                         replication=run.removeprefix("pg-"), writer_s=args.writer_s,
                                         timeout_s=600, progress=print)
                setup = pair.timings
        data = report.as_json()
        results[run] = {**data, "engine_setup": setup}
        print(json.dumps({k: data[k] for k in SHOWN}, indent=2))
        ok = ok and report.ok
    write_result(args.name, results)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
