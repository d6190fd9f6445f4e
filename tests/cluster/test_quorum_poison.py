"""Poison on quorum queues ends in the library's dead-letter store, never dropped by the broker.

Two kinds of poison, through real ``celery worker`` processes on the cluster with
``OUTBOX_BROKER_QUEUE_TYPE=quorum`` (consumer_max_deliveries = 3, as in every chaos run):

* a message the handler always fails on: each failure is a Celery retry, i.e. a NEW broker message,
  so the broker's own delivery count never passes 0; the library counts in the database and
  dead-letters on the third failure;
* a message that kills its worker process every time (a crash point in the handler): each death
  returns the message to the quorum queue, which counts it against ``x-delivery-limit``; the
  library counts the same returns (``redelivered``) and dead-letters it on the fourth delivery, before
  the handler runs again, while the broker would allow ``quorum_delivery_limit + 1`` = 21.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from kombu import Connection, Queue

from celery_outbox.celery.config import quorum_delivery_limit
from celery_outbox.schema import Tables
from chaos.cluster import QUORUM_ENV, ClusterBroker, RabbitCluster
from chaos.environment import ChaosEnvironment
from chaos.load import make_plan
from tests.services import require_service

pytestmark = [pytest.mark.cluster, pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.workers,
              pytest.mark.chaos, pytest.mark.slow]


@pytest.fixture
def quorum_env(rabbit_cluster: RabbitCluster, tmp_path: Path, tables: Tables) -> Iterator[ChaosEnvironment]:
    require_service("PostgreSQL", "127.0.0.1", 5432)
    env = ChaosEnvironment(broker="rabbitmq", workdir=tmp_path / "chaos", tables=tables, extra_env=QUORUM_ENV,
                           broker_impl=ClusterBroker(rabbit_cluster))
    with env:
        yield env


def _ready(env: ChaosEnvironment, consumer: str) -> int:
    with Connection(env.broker.url, connect_timeout=5) as conn:
        _, count, _ = Queue(env.settings.queue_name(consumer), channel=conn.channel()).queue_declare(passive=True)
    return int(count)


def _dead_letters(env: ChaosEnvironment) -> list[tuple[str, str, int]]:
    dl = env.tables.dead_letters
    with env.sessions() as s:
        return [(c, m, n) for c, m, n in s.execute(sa.select(dl.consumer, dl.message_id, dl.delivery_count)).all()]


def test_a_failing_message_is_dead_lettered_by_the_library(quorum_env: ChaosEnvironment,
                                                           rabbit_cluster: RabbitCluster) -> None:
    """Given a poison event on the quorum queue of shipping, when a worker takes it, then after three
    failed deliveries it is in the dead-letter store (not dropped), and the queue is empty."""
    env = quorum_env
    worker = env.worker("worker", queues=["shipping"])
    worker.start()
    consumer, message_id = env.poison(consumer="shipping")
    env.wait(lambda: len(_dead_letters(env)) >= 1, timeout_s=90, what="the poison's dead letter")
    assert _dead_letters(env) == [(consumer, message_id, env.settings.consumer_max_deliveries)]
    qtype = rabbit_cluster.queue_info([env.settings.queue_name("shipping")], ("name", "type"))
    assert qtype == {env.settings.queue_name("shipping"): "quorum"}
    env.wait(lambda: _ready(env, "shipping") == 0, timeout_s=30, what="the queue empty")
    assert worker.alive(), env.logs()


def test_a_message_that_kills_its_worker_is_dead_lettered_before_the_broker_limit(
        quorum_env: ChaosEnvironment) -> None:
    """Given a worker whose every pool process dies in the shipping handler (SIGKILL, message unacked),
    when an order is placed, then its shipping message comes back from the quorum queue after each death,
    and the library dead-letters it once it was delivered more than three times: it is in the store,
    well before the broker's own limit would have dropped it, and nothing is left in the queue."""
    env = quorum_env
    assert quorum_delivery_limit(env.settings) + 1 > env.settings.consumer_max_deliveries + 1
    worker = env.worker("worker", queues=["shipping"], pool="prefork", concurrency=1)
    worker.start(crash_points="consumer_before_commit@1")  # every new pool process dies at its first delivery
    env.relay("relay").start()
    loader = env.orders(make_plan(1, prefix="kill"))
    loader.start()
    assert loader.wait_exit(timeout_s=60) == 0, env.logs()
    env.wait(lambda: len(_dead_letters(env)) >= 1, timeout_s=120, what="the worker-killing message's dead letter")
    outbox = env.tables.outbox
    with env.sessions() as s:
        event_id = s.execute(sa.select(outbox.message_id).where(outbox.type == "OrderPlaced")).scalar_one()
    [(consumer, message_id, deliveries)] = _dead_letters(env)
    assert (consumer, message_id) == ("shipping", str(event_id))
    # three deliveries died with their worker; the fourth found the count over and dead-lettered it
    assert deliveries == env.settings.consumer_max_deliveries
    with env.sessions() as s:
        error = s.execute(sa.select(env.tables.dead_letters.last_error)).scalar_one()
    assert "the worker was lost" in error
    env.wait(lambda: _ready(env, "shipping") == 0, timeout_s=30, what="the queue empty")
    assert worker.alive(), env.logs()  # the parent lived on, replacing its pool processes
