"""Relays on a RabbitMQ cluster: quorum vs classic queues, and 1/2/4 relay processes vs bare publishers.

Starts its own 3-node cluster (chaos/cluster.py; clients connect to node 1 first, as with the failover
URL) and a Postgres database of its own, then, in one run:

1. **quorum vs classic** (``--rows`` rows, one consumer queue, ``--repeat`` interleaved rounds): the
   same-client ceiling (``KombuPublisher.publish_batch`` of prebuilt messages, no database, one confirm
   wait per ``relay_max_in_flight_rows``) and a default ``RelayLoop`` draining the rows, on a classic
   queue and on a quorum queue (``OUTBOX_BROKER_QUEUE_TYPE=quorum``) of the same cluster;
2. **several relays** (``--relays 1,2,4``, ``--queue-type``): N relay processes (each its own
   ``RelayLoop``, engine and connection) draining one outbox of ``--rows`` rows together, against N
   bare kombu publisher processes sending the same number of messages (rows / N each), same broker,
   same round. Contention: drains of a relay that claimed nothing while rows were still pending
   (every due row locked by another relay: SKIP LOCKED misses), and rows another relay had already
   marked (``already_published``: a double publish).

Medians of the rounds; ratios are the comparable part (the machine is shared). Writes
bench/results/cluster_relays.json.

    .venv/bin/python bench/cluster_relays.py [--rows 6000] [--repeat 3] [--relays 1,2,4] [--queue-type quorum]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

from bench._common import fresh_database, write_result
from bench.relay_throughput import ceiling, fill, interleave, messages_for, purge, relay_default
from celery_outbox.celery.kombu_publisher import KombuPublisher
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.schema import define_tables
from celeryconfig import Settings
from chaos.cluster import RabbitCluster, rabbitmq_missing


def _settings(tag: str, url: str, db_url: str, queue_type: str) -> Settings:
    return Settings(namespace=f"bench{tag}{queue_type[0]}", broker_url=url, database_url=db_url,
                    routes={"OrderPlaced": ("shipping",)}, broker_queue_type=queue_type)


# -- one process of part 2 ----------------------------------------------------------------------------
def _relay_proc(settings: Settings, go: Any, out: Any) -> None:
    engine = make_engine(settings.database_url)
    sessions = make_session_factory(engine)
    tables = define_tables(prefix=settings.table_prefix)
    outbox = tables.outbox
    pending = sa.select(sa.func.count()).select_from(outbox).where(outbox.published_at_ms.is_(None),
                                                                    outbox.dead_lettered_at_ms.is_(None))
    stats = {"drains": 0, "batches": 0, "published": 0, "empty_claims_while_pending": 0, "already_published": 0}
    with KombuPublisher(broker_url=settings.broker_url, settings=settings) as pub:
        pub.publish_batch([])
        loop = RelayLoop(settings=settings, tables=tables, session_factory=sessions, publisher=pub, listen=False)
        go.wait()
        while True:
            r = loop.drain_once()
            assert not r.broker_unavailable and r.failed == 0, r
            stats["drains"] += 1
            stats["batches"] += r.batches
            stats["published"] += r.published
            stats["already_published"] += r.already_published
            if r.claimed == 0:
                with sessions() as s:
                    if s.execute(pending).scalar_one() == 0:
                        break
                stats["empty_claims_while_pending"] += 1
        loop.close()
    engine.dispose()
    out.put({**stats, "end": time.time()})


def _publisher_proc(settings: Settings, rows: int, go: Any, out: Any) -> None:
    msgs = messages_for(settings, rows)
    with KombuPublisher(broker_url=settings.broker_url, settings=settings) as pub:
        pub.publish_batch([])
        go.wait()
        step = settings.relay_max_in_flight_rows
        for i in range(0, len(msgs), step):
            report = pub.publish_batch(msgs[i:i + step])
            assert not report.rejected, report.rejected
    out.put({"published": len(msgs), "end": time.time()})


def _run_procs(targets: list[Any]) -> tuple[float, list[dict[str, Any]]]:
    """Start the processes, release them together, return (elapsed s, their results)."""
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=t, args=(go, out)) for t in targets]
    for p in procs:
        p.start()
    time.sleep(3.0)  # every process connected and waiting (spawn imports take a while on 2 cores)
    start = time.time()
    go.set()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return max(r["end"] for r in results) - start, results


def several(settings: Settings, rows: int, n: int, kind: str) -> dict[str, Any]:
    sessions = make_session_factory(make_engine(settings.database_url))
    if kind == "relays":
        fill(sessions, define_tables(prefix=settings.table_prefix), rows)
        elapsed, results = _run_procs([partial(_relay_proc, settings) for _ in range(n)])
    else:
        elapsed, results = _run_procs([partial(_publisher_proc, settings, rows // n) for _ in range(n)])
    sent = sum(r["published"] for r in results)
    return {"rows_per_s": sent / elapsed, "elapsed_s": elapsed,
            **({k: sum(r[k] for r in results) for k in ("drains", "batches", "empty_claims_while_pending",
                                                         "already_published")} if kind == "relays" else {})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=6000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--relays", default="1,2,4")
    ap.add_argument("--queue-type", default="quorum", choices=("classic", "quorum"),
                    help="queue type for the several-relays part")
    ap.add_argument("--skip-types", action="store_true", help="skip part 1 (quorum vs classic)")
    args = ap.parse_args()
    reason = rabbitmq_missing()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    tag = uuid.uuid4().hex[:6]
    results: dict[str, Any] = {"rows": args.rows, "repeat": args.repeat}
    work = Path(tempfile.mkdtemp(prefix="outbox-cluster-relays-"))
    with RabbitCluster(workdir=work / "cluster") as cluster, fresh_database() as db_url:
        url = cluster.url
        results["cluster_startup_s"] = round(cluster.startup_s, 1)
        print(f"cluster up in {cluster.startup_s:.1f}s ({cluster.timings})", flush=True)
        engine = make_engine(db_url)
        sessions = make_session_factory(engine)
        queues: list[str] = []
        try:
            if not args.skip_types:
                runs: dict[str, Any] = {}
                for qtype in ("classic", "quorum"):
                    s = _settings(tag, url, db_url, qtype)
                    queues += [s.queue_name("shipping")]
                    tables = define_tables(prefix=s.table_prefix)
                    runs[f"{qtype}_ceiling"] = partial(ceiling, url, s, args.rows)
                    runs[f"{qtype}_relay"] = partial(relay_default, url, s, sessions, args.rows, tables=tables)
                got = interleave(args.repeat, runs, partial(purge, url, queues))
                types: dict[str, Any] = {}
                for qtype in ("classic", "quorum"):
                    ceil = statistics.median(got[f"{qtype}_ceiling"])
                    relay = statistics.median(r[1] for r in got[f"{qtype}_relay"])
                    types[qtype] = {"ceiling_msgs_per_s": round(ceil), "relay_rows_per_s": round(relay),
                                    "relay_over_ceiling": round(relay / ceil, 3),
                                    "ceiling_runs": [round(c) for c in got[f"{qtype}_ceiling"]],
                                    "relay_runs": [round(r[1]) for r in got[f"{qtype}_relay"]]}
                    print(f"{qtype:>7}: ceiling {ceil:>6.0f} msg/s, relay {relay:>6.0f} rows/s "
                          f"(x{relay / ceil:.2f} of its ceiling); runs {types[qtype]}", flush=True)
                types["quorum_over_classic_relay"] = round(types["quorum"]["relay_rows_per_s"]
                                                           / types["classic"]["relay_rows_per_s"], 3)
                types["quorum_over_classic_ceiling"] = round(types["quorum"]["ceiling_msgs_per_s"]
                                                             / types["classic"]["ceiling_msgs_per_s"], 3)
                print(f"quorum / classic: relay x{types['quorum_over_classic_relay']}, "
                      f"ceiling x{types['quorum_over_classic_ceiling']}", flush=True)
                results["queue_types"] = types
            s = _settings(tag + "m", url, db_url, args.queue_type)
            queues += [s.queue_name("shipping")]
            rows_out: list[dict[str, Any]] = []
            for n in (int(x) for x in args.relays.split(",")):
                got = interleave(args.repeat, {
                    "relays": partial(several, s, args.rows, n, "relays"),
                    "publishers": partial(several, s, args.rows, n, "publishers"),
                }, partial(purge, url, [s.queue_name("shipping")]))
                relay = statistics.median(g["rows_per_s"] for g in got["relays"])
                bare = statistics.median(g["rows_per_s"] for g in got["publishers"])
                row = {"processes": n, "relay_rows_per_s": round(relay), "bare_publishers_msgs_per_s": round(bare),
                       "ratio": round(relay / bare, 3),
                       "empty_claims_while_pending": [g["empty_claims_while_pending"] for g in got["relays"]],
                       "drains": [g["drains"] for g in got["relays"]],
                       "batches": [g["batches"] for g in got["relays"]],
                       "already_published": [g["already_published"] for g in got["relays"]],
                       "relay_runs": [round(g["rows_per_s"]) for g in got["relays"]],
                       "publisher_runs": [round(g["rows_per_s"]) for g in got["publishers"]]}
                rows_out.append(row)
                print(f"{n} process(es): relays {relay:>6.0f} rows/s, bare publishers {bare:>6.0f} msg/s, "
                      f"ratio {relay / bare:.2f}; empty claims while pending {row['empty_claims_while_pending']}, "
                      f"already published {row['already_published']}", flush=True)
            results["several"] = {"queue_type": args.queue_type, "runs": rows_out}
        finally:
            engine.dispose()
    write_result("cluster_relays", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
