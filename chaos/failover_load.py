"""The order writer of a failover run, as its own process: ``python -m chaos.failover_load --plan plan.json
--committed committed.tsv``.

Like ``chaos.load`` it calls the real ``place_order`` for each planned order, but a database error does
not end it: the web app's user clicks again. It waits a little and places the same order again (the
order id is the idempotency key: an order whose commit did reach the database is not placed twice).
After each commit that returned, it appends ``<order id>\\t<commit ms>`` to the committed file: the
orders this client saw committed, the ones a failover must not lose without saying so. It also
prints one line per failed attempt, so the run sees when the database was unreachable.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from celery_outbox.db import make_engine, make_session_factory
from celeryconfig import Settings
from chaos.load import order_body
from orders.models import Order
from orders.service import parse_order, place_order
from relay.factory import create_outbox

RETRY_PAUSE_S = 0.1


def run(plan: list[dict[str, Any]], *, settings: Settings, interval_ms: int, committed: Path) -> None:
    engine = make_engine(settings.effective_database_url, settings=settings)
    sessions = make_session_factory(engine)
    outbox = create_outbox(settings, session_factory=sessions)
    with open(committed, "a", buffering=1) as out:
        for i, item in enumerate(plan):
            order_id = str(item["order_id"])
            req = parse_order(order_body(order_id, index=i))
            while True:
                try:
                    with sessions() as session:
                        if session.get(Order, order_id) is not None:
                            break  # an earlier attempt's commit reached the database after all
                        place_order(session, req, outbox=outbox)
                    out.write(f"{order_id}\t{int(time.time() * 1000)}\n")
                    break
                except Exception as e:  # the database is away (OutboxError or a driver error): the same order again
                    print(f"order {order_id}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                    time.sleep(RETRY_PAUSE_S)
            if interval_ms:
                time.sleep(interval_ms / 1000)
    engine.dispose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--committed", type=Path, required=True)
    parser.add_argument("--interval-ms", type=int, default=0)
    args = parser.parse_args(argv)
    plan = json.loads(args.plan.read_text())
    run(plan, settings=Settings.from_env(), interval_ms=args.interval_ms, committed=args.committed)


if __name__ == "__main__":
    main()
