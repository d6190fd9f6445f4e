"""``OUTBOX_BROKER_QUEUE_TYPE``: every declaration of the library's queues carries the same arguments."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_outbox import Outbox
from celery_outbox.celery.config import celery_config, queue_arguments, quorum_delivery_limit
from celery_outbox.celery.kombu_publisher import KombuPublisher
from celery_outbox.errors import ConfigError
from celery_outbox.settings import Settings

AMQP = "amqp://guest:guest@127.0.0.1:5672//"
FAILOVER = "amqp://guest:guest@127.0.0.1:5672//;amqp://guest:guest@127.0.0.1:5673//"


def test_classic_is_the_default_and_declares_no_arguments() -> None:
    settings = Settings(routes={"E": ("a",)})
    assert settings.broker_queue_type == "classic"
    assert queue_arguments(settings, AMQP) == {}
    assert all(not q.queue_arguments for q in celery_config(settings, AMQP)["task_queues"])


@pytest.mark.parametrize("url", [AMQP, FAILOVER])
def test_quorum_on_rabbitmq_declares_every_library_queue_quorum(url: str) -> None:
    settings = Settings(namespace="ns", routes={"E": ("a", "b")}, broker_queue_type="quorum")
    queues = celery_config(settings, url, consumers=("email",))["task_queues"]
    assert sorted(q.name for q in queues) == ["ns.a", "ns.b", "ns.email", "ns.relay"]
    for q in queues:
        assert q.queue_arguments == {"x-queue-type": "quorum", "x-delivery-limit": quorum_delivery_limit(settings)}
        assert q.durable and not q.auto_delete and not q.exclusive  # what a quorum queue must be


def test_the_publisher_declares_what_the_workers_declare() -> None:
    settings = Settings(namespace="ns", routes={"E": ("a",)}, broker_queue_type="quorum")
    publisher = KombuPublisher(broker_url=FAILOVER, settings=settings)
    assert [getattr(q, "queue_arguments", None) for q in publisher.queues] == [queue_arguments(settings, FAILOVER)]


def test_outbox_adds_its_queues_with_the_same_arguments(sqlite_url: str) -> None:
    """An app configured by ``Outbox`` alone (not ``recommended_celery_config``) gets quorum queues too."""
    app = Celery("t", set_as_current=False)
    app.conf.update(broker_url=AMQP, task_serializer="json", accept_content=["json"])
    outbox = Outbox(app, settings=Settings(namespace="ns", broker_queue_type="quorum", database_url=sqlite_url))

    @outbox.consumer("OrderPlaced", name="shipping")
    def ship(session: object, event: object) -> None:
        return None

    ours = [q for q in app.conf.task_queues if q.name.startswith("ns.")]
    assert {q.name for q in ours} == {"ns.relay", "ns.shipping"}
    assert all(q.queue_arguments == queue_arguments(outbox.settings, AMQP) for q in ours)


@pytest.mark.parametrize("max_deliveries", [1, 3, 10, 11, 1000])
def test_the_broker_limit_stays_above_the_library_count(max_deliveries: int) -> None:
    """A message is delivered limit + 1 times by the broker (tests/cluster/test_cluster.py measures it); the
    library dead-letters on delivery max + 1 at the latest, so the broker must allow at least that many."""
    limit = quorum_delivery_limit(Settings(consumer_max_deliveries=max_deliveries))
    assert limit >= 20
    assert limit + 1 >= 2 * max_deliveries


def test_quorum_with_redis_is_a_clear_error() -> None:
    settings = Settings(broker_queue_type="quorum", routes={"E": ("a",)})
    with pytest.raises(ConfigError, match="needs RabbitMQ"):
        celery_config(settings, "redis://127.0.0.1:6379/0")


def test_a_bad_queue_type_is_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        Settings.from_env({"OUTBOX_BROKER_QUEUE_TYPE": "mirrored"})
    text = str(err.value)
    assert "OUTBOX_BROKER_QUEUE_TYPE" in text and "classic or quorum" in text and "\n" not in text
