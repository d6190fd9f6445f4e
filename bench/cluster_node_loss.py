"""Node loss on a 3-node RabbitMQ cluster with quorum queues, at bench size (chaos/cluster_run.py).

Starts its own cluster (chaos/cluster.py; Debian's rabbitmq-server), runs ``--orders`` orders through the
reference deployment's order writer, relay and two workers on the failover URL, stops node 1 and
restarts it, SIGKILLs node 2 and restarts it, and prints/writes: orders, kills, lost, doubled,
duplicates absorbed, time to recover (relay publishing again, workers committing again, node back),
drain time, cluster startup. Writes bench/results/cluster_node_loss.json.

    .venv/bin/python bench/cluster_node_loss.py [--orders 2000] [--writer-s 90]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_result
from chaos.cluster import RabbitCluster, rabbitmq_missing
from chaos.cluster_run import run_node_loss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=2000)
    parser.add_argument("--writer-s", type=float, default=90.0, help="seconds over which the orders are placed")
    parser.add_argument("--name", default="cluster_node_loss")
    args = parser.parse_args(argv)
    reason = rabbitmq_missing()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="outbox-node-loss-"))
    with RabbitCluster(workdir=work / "cluster") as cluster:
        print(f"cluster up in {cluster.startup_s:.1f}s ({cluster.timings}); {cluster.url}")
        report = run_node_loss(cluster=cluster, orders=args.orders, workdir=work / "run",
                               writer_s=args.writer_s, progress=print)
    data = {**report.as_json(), "cluster_timings": cluster.timings, "writer_s": args.writer_s}
    print(json.dumps({k: data[k] for k in ("orders", "committed", "lost", "doubled", "duplicates_absorbed",
                                           "quiesced", "drain_s", "duration_s", "ok")}, indent=2))
    for loss in report.losses:
        print(f"node {loss.node} {loss.how} at {loss.at_orders} orders: back in {loss.down_s:.1f}s, relay published "
              f"again after {loss.relay_recovered_s}s, workers committed again after {loss.workers_recovered_s}s")
    write_result(args.name, data)
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
