"""Real ``celery worker`` processes (prefork, 2 children, not eager) run the consumers against real
Redis and real RabbitMQ and real Postgres. Messages are published with kombu exactly as the relay
publishes them (``celery_outbox.messages.celery_task_message``), so this needs no relay.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from kombu import Connection, Exchange, Producer, Queue
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.messages import Envelope, celery_task_message
from celeryconfig import Settings
from consumers import default_registry
from consumers.effects import duplicates_absorbed, effect_counts
from consumers.models import Shipment
from consumers.testing import order_placed_envelope
from tests.support.workers import start_worker, stop_worker

pytestmark = [pytest.mark.postgres, pytest.mark.workers, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))
# The consumers the reference deployment's worker registers (``consumers.register``).
CONSUMERS = default_registry().names()


@dataclass
class Worker:
    settings: Settings
    broker_url: str
    log: Path
    proc: subprocess.Popen[bytes]

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-8000:] if self.log.exists() else ""


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url


@pytest.fixture
def worker(broker_url: str, pg_url: str, namespace: str, tmp_path: Path) -> Iterator[Worker]:
    home = tmp_path / "home"
    home.mkdir()
    settings = Settings(home=home, database_url=pg_url, broker_url=broker_url, namespace=namespace,
                        consumer_max_deliveries=3, consumer_retry_backoff_s=1, consumer_retry_backoff_max_s=2)
    declare(settings, broker_url)  # so nothing published before the worker is up is dropped (Redis)
    env = {**os.environ, "OUTBOX_DATABASE_URL": pg_url, "OUTBOX_BROKER_URL": broker_url,
           "OUTBOX_NAMESPACE": namespace, "OUTBOX_HOME": str(home), "OUTBOX_CONSUMER_MAX_DELIVERIES": "3",
           "OUTBOX_CONSUMER_RETRY_BACKOFF_S": "1", "OUTBOX_CONSUMER_RETRY_BACKOFF_MAX_S": "2"}
    env.pop("OUTBOX_CRASH_POINTS", None)
    log = tmp_path / "worker.log"
    proc = start_worker(env=env, queues=[settings.queue_name(c) for c in CONSUMERS], node=f"consumers-{namespace}@%h",
                        log=log)
    w = Worker(settings=settings, broker_url=broker_url, log=log, proc=proc)
    try:
        yield w
    finally:
        stop_worker(proc)
        cleanup(settings, broker_url)


def _queues(settings: Settings) -> tuple[Exchange, list[Queue]]:
    exchange = Exchange(settings.exchange_name, type="direct", durable=True)
    return exchange, [Queue(settings.queue_name(c), exchange, routing_key=settings.queue_name(c), durable=True)
                      for c in CONSUMERS]


def declare(settings: Settings, url: str) -> None:
    _, queues = _queues(settings)
    with Connection(url) as conn:
        channel = conn.channel()
        for q in queues:
            q(channel).declare()


def cleanup(settings: Settings, url: str) -> None:
    exchange, queues = _queues(settings)
    with Connection(url) as conn:
        channel = conn.channel()
        for q in queues:
            q(channel).delete()
        exchange(channel).delete()


def publish(settings: Settings, url: str, items: list[tuple[Envelope, str]]) -> None:
    exchange, _ = _queues(settings)
    with Connection(url) as conn:
        producer = Producer(conn.channel(), exchange=exchange)
        for envelope, consumer in items:
            msg = celery_task_message(envelope, consumer=consumer, routing_key=settings.queue_name(consumer))
            producer.publish(msg.body, routing_key=msg.routing_key, headers=msg.headers,
                             content_type="application/json", content_encoding="utf-8", delivery_mode=2,
                             **msg.properties)


def wait_for(what: str, predicate: object, worker: Worker, sessions: sessionmaker[Session],
             timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        with sessions() as s:
            ok, last = predicate(s)  # type: ignore[operator]
        if ok:
            return
        if worker.proc.poll() is not None:
            pytest.fail(f"worker exited with {worker.proc.returncode} while waiting for {what}\n{worker.logs()}")
        time.sleep(0.25)
    pytest.fail(f"timed out waiting for {what}; last state {last!r}\n--- worker log ---\n{worker.logs()}")


def test_real_worker_fan_out_duplicates_and_poison(worker: Worker, tables: Tables) -> None:
    settings, url = worker.settings, worker.broker_url
    sessions = make_session_factory(make_engine(settings.effective_database_url))
    # Given a poison message ("not json" payload) at the head of the shipping queue
    poison = Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload="not json", headers={})
    orders = [order_placed_envelope(f"o-{i}") for i in range(3)]
    items: list[tuple[Envelope, str]] = [(poison, "shipping")]
    # And three orders fanned out to every consumer of the deployment behind it, the first one's shipping copy
    # published three times (a relay that crashed before marking, twice)
    items += [(env, c) for env in orders for c in CONSUMERS]
    items += [(orders[0], "shipping"), (orders[0], "shipping")]
    # When they are published as the relay would
    publish(settings, url, items)

    dead_letters = tables.dead_letters

    def done(s: Session) -> tuple[bool, object]:
        state = (effect_counts(s), duplicates_absorbed(s, tables),
                 s.execute(sa.select(dead_letters.consumer, dead_letters.delivery_count)).all())
        effects = {c: state[0].get(c) for c in CONSUMERS}
        return effects == dict.fromkeys(CONSUMERS, 3) and state[1].get("shipping") == 2 and len(state[2]) == 1, state

    wait_for("all effects, two duplicates absorbed and one dead letter", done, worker, sessions)
    # Then exactly one effect per (order, consumer), the duplicates absorbed by the inbox
    with sessions() as s:
        assert sorted(s.execute(sa.select(Shipment.order_id)).scalars()) == ["o-0", "o-1", "o-2"]
        assert s.execute(sa.select(sa.func.count()).select_from(tables.inbox)).scalar_one() == 3 * len(CONSUMERS)
        # And the poison was delivered 3 times (max 3), then dead-lettered with its raw body
        [dl] = s.execute(sa.select(dead_letters)).scalars().all()
        assert (dl.consumer, dl.message_id, dl.delivery_count) == ("shipping", str(poison.message_id), 3)
        assert "payload is not JSON" in dl.last_error and '"not json"' in dl.body
        assert dl.first_failed_at_ms < dl.last_failed_at_ms  # redelivered with backoff, not in a tight loop
    sessions.kw["bind"].dispose()
    assert worker.proc.poll() is None, worker.logs()
