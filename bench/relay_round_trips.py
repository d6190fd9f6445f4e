"""Round trips to Postgres per relay wake-up at one order per wake-up (issue #24): a count, not a timing.

One order is committed through the reference Orders service (the order, its ``OrderPlaced`` event and
the confirmation e-mail task's row), then the relay does what ``outbox relay`` does per wake-up:
``drain_once``, ``periodic_jobs`` and the due-time read before its sleep (``RelayLoop._until_due_s``; on
a tree without it, ``until_next_due_s``). SQLAlchemy events on the relay's own engine count its
statements, pool checkouts (each one a pre-ping ``SELECT 1``), transactions begun (psycopg2 sends
``BEGIN`` on its own), commits and rollbacks, over ``--wakeups`` wake-ups after 5 of warm-up; RabbitMQ.
With ``--baseline-src DIR`` the same count runs on another source tree (put first on PYTHONPATH) first.
Writes bench/results/relay_round_trips.json.

    .venv/bin/python bench/relay_round_trips.py [--wakeups 50] [--baseline-src /tmp/base]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def count(wakeups: int, broker_url: str) -> dict[str, float]:
    """The per-wake-up counts of the relay code importable here (the child's PYTHONPATH: the tree first)."""
    from sqlalchemy import event

    from bench._common import fresh_database
    from celery_outbox.celery.kombu_publisher import KombuPublisher
    from celery_outbox.db import make_engine, make_session_factory
    from celery_outbox.relay.loop import RelayLoop
    from celeryconfig import Settings
    from chaos.load import order_body
    from orders.service import parse_order, place_order
    from relay.factory import create_outbox

    with fresh_database() as url:
        settings = Settings.from_env({"OUTBOX_DATABASE_URL": url, "OUTBOX_BROKER_URL": broker_url,
                                      "OUTBOX_NAMESPACE": f"trips{uuid.uuid4().hex[:6]}"})
        writer = make_engine(url, settings=settings)
        writes = make_session_factory(writer)
        outbox = create_outbox(settings, session_factory=writes)
        engine = make_engine(url, settings=settings)  # the relay's own: only its round trips are counted
        n = {"statements": 0, "checkouts_pre_ping": 0, "begins": 0, "commits": 0, "rollbacks": 0}

        def bump(key: str) -> Any:
            def on(*_: Any) -> None:
                n[key] += 1
            return on

        event.listen(engine, "before_cursor_execute", bump("statements"))
        event.listen(engine.pool, "checkout", bump("checkouts_pre_ping"))
        event.listen(engine, "begin", bump("begins"))
        event.listen(engine, "commit", bump("commits"))
        event.listen(engine, "rollback", bump("rollbacks"))
        routes = outbox.routes()
        consumers = tuple(dict.fromkeys(c for names in routes.values() for c in names))
        publisher = KombuPublisher(broker_url=broker_url, settings=settings, consumers=consumers)
        loop = RelayLoop(settings=settings, tables=outbox.tables, session_factory=make_session_factory(engine),
                         publisher=publisher, listen=False, routes=routes)
        before_sleep = getattr(loop, "_until_due_s", loop.until_next_due_s)

        def wake(i: int) -> None:
            with writes() as s:
                place_order(s, parse_order(order_body(f"trip-{i}", index=i)), outbox=outbox)
            loop.drain_once()
            loop.periodic_jobs()
            before_sleep()

        for i in range(5):
            wake(i)
        n = dict.fromkeys(n, 0)
        for i in range(5, 5 + wakeups):
            wake(i)
        publisher.close()
        loop.close()
        engine.dispose()
        writer.dispose()
    out = {k: v / wakeups for k, v in n.items()}
    out["round_trips"] = sum(out.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--wakeups", type=int, default=50)
    parser.add_argument("--broker-url", default="amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--baseline-src", default="", help="a source tree counted first, as 'base'")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path[:0] = [p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p]
        print(json.dumps(count(args.wakeups, args.broker_url)))
        return
    trees = {**({"base": args.baseline_src} if args.baseline_src else {}), "this": str(REPO)}
    got: dict[str, dict[str, float]] = {}
    for name, src in trees.items():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(REPO)])}
        proc = subprocess.run([sys.executable, __file__, "--child", "--wakeups", str(args.wakeups), "--broker-url",
                               args.broker_url], env=env, capture_output=True, text=True, check=True)
        got[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name:5s} per wake-up: " + ", ".join(f"{k} {v:g}" for k, v in got[name].items()), flush=True)
    sys.path.insert(0, str(REPO))
    from bench._common import write_result

    write_result("relay_round_trips", {"wakeups": args.wakeups, "trees": trees, "per_wakeup": got})


if __name__ == "__main__":
    main()
