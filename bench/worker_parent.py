"""What the outbox adds per message in a prefork worker's PARENT process (one thread, serial for every
pool process), piece by piece, in microseconds of CPU per message:

* ``strategy``: ``strategy.canonical_message`` for a consumer message as the relay publishes it (the
  raw body read, checked and rebuilt before Celery unpacks it);
* ``gate``: ``Gate.check`` for a plain ``@app.task`` message captured through the outbox (the rule table
  of ``task_rules`` over the raw body);
* ``receipts``: the ``task_received`` handler of ``celery/receipts.py`` for a message without an eta
  (what every message costs there: the receipt kept pending, the ack wrapped; the batch written
  before the ack is not in it);
* ``events_confirmed`` / ``events_unconfirmed``: the three task events a worker sends per task
  (received, started, succeeded), published through a real broker with and without publisher confirms
  (``celery/events.py``, ``UnconfirmedTaskEvents``), CPU and wall time per message (the parent waits
  for each confirm).

Prints the medians of ``--rounds`` and writes bench/results/worker_parent.json.

    .venv/bin/python bench/worker_parent.py [--messages 2000] [--rounds 5] [--broker amqp://guest:guest@127.0.0.1:5672//]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery import Celery

from bench._common import write_result
from celery_outbox import Outbox, Settings
from celery_outbox.celery.events import without_confirms
from celery_outbox.celery.gate import Gate
from celery_outbox.celery.receipts import Receipts
from celery_outbox.celery.strategy import canonical_message
from celery_outbox.messages import celery_task_message, task_name
from consumers.testing import order_placed_envelope


class Message:
    """The attributes of a kombu message the strategy and the gate read."""

    def __init__(self, body: bytes, headers: dict[str, Any], properties: dict[str, Any], routing_key: str) -> None:
        self.body = body
        self.headers = headers
        self.properties = properties
        self.content_type = "application/json"
        self.content_encoding = "utf-8"
        self.delivery_info = {"exchange": "x", "routing_key": routing_key, "redelivered": False}


def cpu_us(fn: Any, n: int) -> float:
    t = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t) * 1e6 / n


def wall_us(fn: Any, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) * 1e6 / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--broker", default=os.environ.get("OUTBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//"))
    args = parser.parse_args()
    n = args.messages
    home = tempfile.mkdtemp(prefix="worker-parent-")
    settings = Settings(database_url=f"sqlite:///{home}/db.sqlite3", broker_url=args.broker, namespace="wp")
    app = Celery("worker-parent", set_as_current=False)
    outbox = Outbox(app, settings=settings)
    app.conf.update(broker_url=args.broker, broker_transport_options={"confirm_publish": True})

    @app.task(name="bench.plain", ignore_result=True)  # type: ignore[untyped-decorator]
    def plain(order_id: str, lines: list[dict[str, Any]]) -> None:
        return None

    env = order_placed_envelope("o-1")
    msg = celery_task_message(env, consumer="shipping", routing_key="wp.shipping")
    consumer_message = Message(msg.body.encode(), dict(msg.headers), dict(msg.properties), "wp.shipping")
    tid = str(uuid.uuid4())
    task_msg = app.amqp.as_task_v2(tid, "bench.plain", args=["o-1", env.payload["lines"]], kwargs={})
    plain_message = Message(json.dumps(list(task_msg.body)).encode(),
                            {**task_msg.headers, "outbox_receipt": 1}, dict(task_msg.properties), "wp.relay")
    gate = Gate(outbox)
    rules = gate.rules_for(plain)
    receipts = Receipts(outbox)
    request = SimpleNamespace(eta=None, task=plain, request_dict=plain_message.headers, id=tid,
                              _on_ack=lambda *a: None, _on_reject=lambda *a: None)
    consumer_task = task_name("shipping")

    def strategy() -> None:
        canonical_message(consumer_message, task_name=consumer_task, settings=settings, route=("x", "wp.shipping"),
                          max_eta_s=120.0)

    def gate_check() -> None:
        gate.check(plain_message, None, "bench.plain", rules)

    def receipt() -> None:
        receipts.on_received(sender=None, request=request)

    def events_of(confirmed: bool) -> Any:
        conn = app.connection_for_write()
        conn.ensure_connection(max_retries=1)
        dispatcher = app.events.Dispatcher(conn, hostname="bench@parent", enabled=True)
        if not confirmed:
            assert without_confirms(SimpleNamespace(app=app, event_dispatcher=dispatcher, amqheartbeat=None,
                                                    ensure_connected=lambda c: c.ensure_connection(max_retries=1) and c))

        def send() -> None:
            for kind in ("task-received", "task-started", "task-succeeded"):
                dispatcher.send(kind, uuid=tid, name=consumer_task)

        return dispatcher, send

    confirmed, send_confirmed = events_of(True)
    unconfirmed, send_unconfirmed = events_of(False)
    pieces = {"strategy": (strategy, cpu_us), "gate": (gate_check, cpu_us), "receipts": (receipt, cpu_us),
              "events_confirmed_cpu": (send_confirmed, cpu_us), "events_unconfirmed_cpu": (send_unconfirmed, cpu_us),
              "events_confirmed_wall": (send_confirmed, wall_us),
              "events_unconfirmed_wall": (send_unconfirmed, wall_us)}
    rounds: list[dict[str, float]] = []
    try:
        for r in range(args.rounds + 1):  # round 0 warms up
            row = {name: measure(fn, n if not name.startswith("events") else max(100, n // 4))
                   for name, (fn, measure) in pieces.items()}
            if r:
                rounds.append(row)
                print(f"round {r}: " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()))
    finally:
        for d in (confirmed, unconfirmed):
            d.close()
            d.connection.close()
    med = {k: statistics.median(rd[k] for rd in rounds) for k in pieces}
    print(f"\nmicroseconds per message in the worker parent (median of {len(rounds)} rounds; events: three per "
          "message, real broker):")
    for k, v in med.items():
        print(f"  {k:20} {v:9.1f}")
    for kind in ("cpu", "wall"):
        ratio = med[f"events_confirmed_{kind}"] / med[f"events_unconfirmed_{kind}"]
        print(f"  events confirmed / unconfirmed, {kind}: {ratio:.2f}x")
    write_result("worker_parent", {"messages": n, "rounds": len(rounds), "median_us": med, "rounds_detail": rounds,
                                   "broker": args.broker.split("@")[-1]})


if __name__ == "__main__":
    main()
