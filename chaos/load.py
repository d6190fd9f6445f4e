"""The order writer of a chaos run, as its own process: ``python -m chaos.load --plan plan.json``.

It calls the real ``place_order`` for each planned order. A planned rollback makes the transaction
fail after its INSERTs reached Postgres (an ``after_flush`` hook raises), so the order and its
outbox row are written and rolled back. Armed with ``after_order_commit`` it SIGKILLs itself right
after a commit; restarted, it skips orders already committed and carries on with the plan.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from celery_outbox import Outbox
from celery_outbox.crashpoints import CrashPoints
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.errors import OutboxError
from celeryconfig import Settings
from orders.models import Order
from orders.service import OrderRequest, parse_order, place_order
from relay.factory import create_outbox


class InjectedRollback(OutboxError):
    """Raised on purpose inside an order's transaction so it must roll back."""


def order_body(order_id: str, *, index: int) -> dict[str, Any]:
    return {
        "order_id": order_id,
        "customer_id": f"c{index % 17}",
        "email": f"buyer{index}@example.com",
        "currency": "EUR",
        "lines": [{"sku": f"sku-{index % 5}", "quantity": 1 + index % 3, "unit_price_cents": 100 + index}],
    }


def make_plan(n: int, *, prefix: str = "o", rollback: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
    """``n`` planned orders with unique ids; indexes in ``rollback`` are to fail inside their transaction."""
    tag = uuid.uuid4().hex[:6]
    return [{"order_id": f"{prefix}-{tag}-{i}", "rollback": i in rollback} for i in range(n)]


def _fail_after_flush(session: Session, _ctx: Any) -> None:
    raise InjectedRollback("injected failure after the order's INSERTs, before COMMIT")


def place_rolled_back(session: Session, req: OrderRequest, *, outbox: Outbox) -> bool:
    """Run place_order in a transaction that fails after flushing; True if it rolled back."""
    event.listen(session, "after_flush", _fail_after_flush)
    try:
        place_order(session, req, outbox=outbox)
    except InjectedRollback:
        return True
    finally:
        event.remove(session, "after_flush", _fail_after_flush)
    return False


def run(plan: list[dict[str, Any]], *, settings: Settings, interval_ms: int) -> None:
    engine = make_engine(settings.effective_database_url)
    sessions = make_session_factory(engine)
    outbox = create_outbox(settings, session_factory=sessions)
    crash_points = CrashPoints(spec=settings.crash_points)
    for i, item in enumerate(plan):
        order_id = str(item["order_id"])
        req = parse_order(order_body(order_id, index=i))
        with sessions() as session:
            if item.get("rollback"):
                place_rolled_back(session, req, outbox=outbox)
            elif session.get(Order, order_id) is None:
                place_order(session, req, outbox=outbox, crash_points=crash_points)
            else:
                continue
        if interval_ms:
            time.sleep(interval_ms / 1000)
    engine.dispose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--interval-ms", type=int, default=0)
    args = parser.parse_args(argv)
    plan = json.loads(args.plan.read_text())
    run(plan, settings=Settings.from_env(), interval_ms=args.interval_ms)


if __name__ == "__main__":
    main()
