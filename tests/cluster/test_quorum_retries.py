"""Consumer retries with backoff on quorum queues wait in the broker's delay chain (celery/delayed_retry.py).

A real ``celery worker`` (prefork) of ``tests/cluster/retryapp.py`` on the 3-node cluster, the library's own
Celery configuration with ``OUTBOX_BROKER_QUEUE_TYPE=quorum``, backoff 1 s then 2 s, 3 deliveries at most:

* a consumer that fails twice then succeeds: one effect, after two retries, each of which the broker
  delivered from its delay chain once due (RabbitMQ's ``x-death``: dead-lettered by a
  ``celery_delayed_<n>`` queue), none held by the worker that failed it;
* a consumer that always fails: in the dead-letter store after its 3 deliveries, its queue empty;
* the worker's start no longer logs Celery's "is a direct exchange and native delayed delivery do not
  support direct exchanges" for the library's exchanges.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from kombu import Connection, Queue

from celery_outbox import Envelope
from celery_outbox.celery.kombu_publisher import KombuPublisher
from celery_outbox.db import make_engine
from celery_outbox.messages import celery_task_message
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings
from chaos.cluster import RabbitCluster
from devtools.processes import Child, wait_until
from tests.cluster import retryapp
from tests.services import require_service

pytestmark = [pytest.mark.cluster, pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.workers,
              pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
WARNINGS = ("native delayed delivery do not support direct exchanges",
            "Direct exchanges are not supported with native delayed delivery")


@pytest.fixture
def settings(rabbit_cluster: RabbitCluster, pg_url: str) -> Iterator[Settings]:
    require_service("PostgreSQL", "127.0.0.1", 5432)
    engine = make_engine(pg_url)
    retryapp.metadata.create_all(engine)
    with engine.begin() as c:
        c.execute(retryapp.effects.delete())
    try:
        yield Settings(namespace=f"r{uuid.uuid4().hex[:10]}", database_url=pg_url, broker_url=rabbit_cluster.url,
                       broker_queue_type="quorum", routes=retryapp.ROUTES, consumer_max_deliveries=3,
                       consumer_retry_backoff_s=1, consumer_retry_backoff_max_s=2)
    finally:  # the session's database is shared: a test's own table must not outlive it (test_migrations lists them)
        retryapp.metadata.drop_all(engine)
        engine.dispose()


def _publish(settings: Settings, event_type: str, consumer: str) -> str:
    envelope = Envelope(message_id=uuid.uuid4(), type=event_type, payload={"n": 1}, headers={}, created_at_ms=0)
    message = celery_task_message(envelope, consumer=consumer, routing_key=settings.queue_name(consumer))
    with KombuPublisher(broker_url=str(settings.broker_url), settings=settings) as publisher:
        report = publisher.publish_batch([message])
    assert not report.rejected, report
    return str(envelope.message_id)


def _ready(settings: Settings, consumer: str) -> int:
    with Connection(str(settings.broker_url), connect_timeout=5) as conn:
        _, count, _ = Queue(settings.queue_name(consumer), channel=conn.channel()).queue_declare(passive=True)
    return int(count)


@pytest.mark.timeout(300)
def test_retries_wait_in_the_broker_then_succeed_or_dead_letter(settings: Settings, tmp_path: Path,
                                                                tables: Tables) -> None:
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(settings.to_env())
    env.update(RETRYAPP_HOME=str(home), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    queues = ",".join(settings.queue_name(c) for c in ("flaky", "broken"))
    worker = Child(name="worker", cwd=ROOT, env=env, log_path=tmp_path / "worker.log", argv=[
        sys.executable, "-m", "celery", "-A", "tests.cluster.retryapp", "worker", "-Q", queues, "-P", "prefork",
        "-c", "2", "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
        "-n", f"retry-{settings.namespace}@%h"]).start()
    engine = make_engine(str(settings.database_url))
    try:
        assert wait_until(lambda: "ready." in worker.log_tail(100_000), timeout_s=90), worker.log_tail()
        # Given a message its consumer fails on twice, and one its consumer always fails on
        flaky = _publish(settings, "Flaky", "flaky")
        broken = _publish(settings, "Broken", "broken")

        def effects() -> int:
            with engine.connect() as c:
                return int(c.execute(sa.select(sa.func.count()).select_from(retryapp.effects)
                                     .where(retryapp.effects.c.message_id == flaky)).scalar_one())

        def dead_letters() -> list[tuple[str, str, int]]:
            dl = tables.dead_letters
            with engine.connect() as c:
                return [(r.consumer, r.message_id, r.delivery_count)
                        for r in c.execute(sa.select(dl.consumer, dl.message_id, dl.delivery_count))]

        # When the worker takes them and retries each failure with the consumer's backoff
        assert wait_until(lambda: effects() >= 1 and bool(dead_letters()), timeout_s=120), worker.log_tail()
        # Then the flaky one took effect once, on its third delivery, and the broken one is in the dead-letter
        # store after its three deliveries
        assert effects() == 1
        assert retryapp.calls(home, "flaky", flaky) == 3
        assert dead_letters() == [("broken", broken, settings.consumer_max_deliveries)]
        assert retryapp.calls(home, "broken", broken) == 3
        # ... and each retry came back from the broker's delay chain (its countdown's bits before the queue's
        # name, dead-lettered by a celery_delayed_<n> queue when due), none held by the worker that failed it
        for consumer in ("flaky", "broken"):
            name = settings.queue_name(consumer)
            path = [(key, deaths) for _, key, deaths in retryapp.received(home) if key.endswith(name)]
            assert len(path) == 3, path
            assert path[0] == (name, ()), path
            for key, deaths in path[1:]:
                assert re.fullmatch(rf"(?:[01]\.){{28}}{re.escape(name)}", key), path
                assert deaths and all(d.startswith("celery_delayed_") for d in deaths), path
        assert wait_until(lambda: _ready(settings, "flaky") + _ready(settings, "broken") == 0, timeout_s=30)
        # ... and the worker said nothing about direct exchanges, and where its retries wait
        log = worker.log_tail(100_000)
        assert not [w for w in WARNINGS if w in log], log
        assert "retries wait in the broker's delay chain" in log, log
        assert worker.alive, log
    finally:
        worker.stop()
        engine.dispose()
