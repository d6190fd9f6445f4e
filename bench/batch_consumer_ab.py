"""A/B of the batch consumer between two source trees, in one run: CPU ms per message, by process.

``bench/batch_consumer.py``'s batch mode twice, side by side: worker A runs from ``--base`` (a source tree of
another commit, e.g. ``git archive <commit> | tar -x -C /tmp/base``; its worker imports the library, the bench
and the reference deployment from that tree: ``PYTHONPATH`` and the working directory point there), worker B
from this checkout; each on a namespace of its own, the same database, venv, broker and options
(``--batch-size``, ``--batch-wait-ms``, ``--prefetch``). With celery-batches installed, its worker (C, from this
checkout) runs too. Rounds of ``--deliveries`` after a warm-up, the order rotating from round to round; medians
of each process kind and the ratios B / A (and C / A, C / B), the mean batch of each (distinct effect instants:
one per batch, as ``effect_now_ms`` stamps a batch's documents), written to ``bench/results/batch_consumer_ab.json``.

    git archive <commit> | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    flock /tmp/heavy.lock .venv/bin/python bench/batch_consumer_ab.py --base /tmp/base [--rounds 4] [--deliveries 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402
from kombu import Connection  # noqa: E402

from bench import batch_consumer as bc  # noqa: E402
from bench._common import consuming, fresh_database, write_result  # noqa: E402
from bench.consumer_cpu import BROKER_URL, PROCESSES, Worker  # noqa: E402

MODE = {"A": "batch", "B": "batch", "C": "batches"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", type=Path, required=True, help="the source tree of worker A")
    parser.add_argument("--deliveries", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--batch-wait-ms", type=int, default=50)
    parser.add_argument("--prefetch", type=int, default=100)
    args = parser.parse_args()
    trees = {"A": args.base.resolve(), "B": ROOT}
    variants = ["A", "B", *(["C"] if bc.have_celery_batches() else [])]
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    batches: dict[str, tuple[int, int]] = {}
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        from celery_outbox.db import make_engine

        engine = make_engine(url)
        started: dict[str, Worker] = {}
        namespace: dict[str, str] = {}
        queues: list[str] = []
        exchanges: list[str] = []
        for v in variants:
            tree = trees.get(v, ROOT)
            ns = namespace[v] = namespace.get("B", "") if v == "C" else f"batchab{v.lower()}{uuid.uuid4().hex[:6]}"
            env = {**os.environ, "OUTBOX_DATABASE_URL": f"{url}?application_name=bench_ab_{v}",
                   "OUTBOX_BROKER_URL": BROKER_URL, "OUTBOX_NAMESPACE": ns, "OUTBOX_HOME": tmp,
                   "BENCH_BROKER_URL": BROKER_URL, "BENCH_NAMESPACE": ns, "BENCH_BATCH_SIZE": str(args.batch_size),
                   "BENCH_BATCH_WAIT_MS": str(args.batch_wait_ms), "BENCH_PREFETCH": str(args.prefetch),
                   "BENCH_DB_URL": url, "BENCH_DB_URL_BATCHES": f"{url}?application_name=bench_ab_{v}",
                   "PYTHONPATH": str(tree)}
            env.pop("OUTBOX_CRASH_POINTS", None)
            queue = f"{ns}.batches" if v == "C" else f"{ns}.{bc.CONSUMER}"
            started[v] = Worker(mode=MODE[v], app=f"bench.batch_consumer:{MODE[v]}", queue=queue, env=env,
                                log=Path(tmp) / f"{v}.log", app_name=f"bench_ab_{v}", cwd=tree)
            queues.append(queue)
            exchanges += [f"{ns}.batches"] if v == "C" else [f"{ns}.events", f"{ns}.relay"]
        with consuming(started, broker_url=BROKER_URL, queues=queues, exchanges=exchanges) as running, \
                Connection(BROKER_URL) as conn:
            for v in variants:  # warm-up: connections, pools, imports
                bc.run_round(MODE[v], running[v], engine, namespace[v], f"warm-{v}", max(100, args.deliveries // 4),
                             conn)
            for r in range(args.rounds):
                for v in variants[r % len(variants):] + variants[:r % len(variants)]:
                    per = bc.run_round(MODE[v], running[v], engine, namespace[v], f"r{r}-{v}", args.deliveries, conn)
                    results[v].append(per)
                    print(f"round {r + 1} {v}: " + "  ".join(f"{k} {x:.3f}" for k, x in per.items()), flush=True)
        with engine.connect() as c:
            for v in variants:
                n, b = c.execute(sa.text("SELECT count(*), count(DISTINCT updated_at_ms) FROM search_documents "
                                         "WHERE order_id LIKE :p"), {"p": f"r%-{v}-%"}).one()
                batches[v] = (int(n), int(b))
        engine.dispose()
    keys = [*PROCESSES, "total", "total_without_broker", "deliveries_per_s"]
    med = {v: {k: statistics.median(p[k] for p in results[v]) for k in keys} for v in variants}
    pairs = [("B", "A"), *([("C", "A"), ("C", "B")] if "C" in med else [])]
    print(f"\nCPU ms per message, median of {args.rounds} rotated rounds of {args.deliveries}: A = {trees['A']}, "
          f"B = {ROOT}" + (", C = celery-batches" if "C" in med else ""))
    print(f"{'process':22}" + "".join(f"{v:>9}" for v in variants) + "".join(f"{x + '/' + y:>8}" for x, y in pairs))
    for k in keys:
        print(f"{k:22}" + "".join(f"{med[v][k]:9.3f}" for v in variants)
              + "".join(f"{med[x][k] / med[y][k] if med[y][k] else float('nan'):8.2f}" for x, y in pairs))
    for v, (n, b) in batches.items():
        print(f"{v}: {n} messages in about {b} batches (mean {n / max(b, 1):.1f})")
    write_result("batch_consumer_ab", {
        "base": str(trees["A"]), "deliveries_per_round": args.deliveries, "rounds": args.rounds,
        "batch_size": args.batch_size, "prefetch": args.prefetch, "median": med, "rounds_detail": results,
        "mean_batch_size": {v: round(n / max(b, 1), 2) for v, (n, b) in batches.items()}})


if __name__ == "__main__":
    main()
