"""What a real outbox worker (prefork, RabbitMQ with publisher confirms) sends as task events per delivery:
the three Flower needs (received, started, succeeded), each once, and nothing else about that task
(celery_outbox/celery/events.py: ``UnconfirmedTaskEvents`` moves them to a connection without confirms,
it adds none; the library's own events are sent only for duplicates, dead letters and reconciles)."""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Exchange, Producer, Queue

from celery_outbox.messages import celery_task_message
from celeryconfig import Settings
from consumers.testing import order_placed_envelope
from tests.support.workers import start_worker, stop_worker

pytestmark = [pytest.mark.postgres, pytest.mark.workers, pytest.mark.slow]
CONSUMER = "shipping"


def _events(message: Any) -> list[dict[str, Any]]:
    """The task events one broker message carries (Celery sends a buffered batch as ``task.multi``)."""
    body = message.decode()
    return body if isinstance(body, list) else [body]


def test_a_delivery_sends_received_started_succeeded_once_and_nothing_more(
        rabbitmq_url: str, pg_url: str, namespace: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    settings = Settings(home=home, database_url=pg_url, broker_url=rabbitmq_url, namespace=namespace)
    queue_name = settings.queue_name(CONSUMER)
    exchange = Exchange(settings.exchange_name, type="direct", durable=True)
    work = Queue(queue_name, exchange, routing_key=queue_name, durable=True)
    listen = Queue(f"{namespace}-events", Exchange("celeryev", type="topic"), routing_key="task.#", auto_delete=True)
    env = {**os.environ, "OUTBOX_DATABASE_URL": pg_url, "OUTBOX_BROKER_URL": rabbitmq_url,
           "OUTBOX_NAMESPACE": namespace, "OUTBOX_HOME": str(home)}
    env.pop("OUTBOX_CRASH_POINTS", None)
    with Connection(rabbitmq_url) as conn:
        channel = conn.channel()
        work(channel).declare()
        events = listen(channel)
        events.declare()
        log = tmp_path / "worker.log"
        proc = start_worker(env=env, queues=[queue_name], node=f"events-{namespace}@%h", log=log, extra=["-E"])
        try:
            # Given a real outbox worker with task events on (-E: the library's configuration leaves them off)
            # When one message is delivered to a consumer the way the relay publishes it
            msg = celery_task_message(order_placed_envelope("o-events"), consumer=CONSUMER, routing_key=queue_name)
            Producer(channel, exchange=exchange).publish(
                msg.body, routing_key=queue_name, headers=msg.headers, content_type="application/json",
                content_encoding="utf-8", delivery_mode=2, **msg.properties)
            task_id = msg.headers["id"]
            seen: list[dict[str, Any]] = []
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and not any(e.get("type") == "task-succeeded" for e in seen):
                message = events.get(no_ack=True)
                if message is None:
                    assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
                    time.sleep(0.2)  # a wait for the broker, not a timing check
                    continue
                seen += [e for e in _events(message) if e.get("uuid") == task_id]
            time.sleep(1.0)  # anything sent after the success arrives too
            while (message := events.get(no_ack=True)) is not None:
                seen += [e for e in _events(message) if e.get("uuid") == task_id]
            # Then the task's events are the three Flower needs, each exactly once, from the worker's node
            assert Counter(e["type"] for e in seen) == Counter(
                {"task-received": 1, "task-started": 1, "task-succeeded": 1}), log.read_text(errors="replace")[-4000:]
            assert {e["hostname"] for e in seen} == {f"events-{namespace}@{socket.gethostname()}"}
        finally:
            stop_worker(proc)
            events.delete()
            work(channel).delete()
            exchange(channel).delete()
