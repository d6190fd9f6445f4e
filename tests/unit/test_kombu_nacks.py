"""A RabbitMQ nack is the queue's trouble, not the message's: the publisher sends the nacked messages
again within the publish timeout, and past it fails the batch as ``BrokerUnavailableError`` (the relay's
breaker, no attempt charged). The broker side is a stand-in here; tests/cluster/test_node_loss.py is
the real case (a quorum queue's leader lost)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from celery_outbox.celery.kombu_publisher import KombuPublisher
from celery_outbox.errors import BrokerUnavailableError
from celery_outbox.messages import Envelope, TaskMessage, celery_task_message
from celery_outbox.settings import Settings


class Broker:
    """Confirms what was published: nacks the first ``nacks`` publishes of each message, acks the rest."""

    def __init__(self, publisher: KombuPublisher, *, nacks: int) -> None:
        self.publisher = publisher
        self.nacks = nacks
        self.sent: list[str] = []
        self._unconfirmed: list[int] = []

    # the producer
    def publish(self, body: Any, **kw: Any) -> None:
        self.sent.append(kw["correlation_id"])
        self._unconfirmed.append(self.publisher._next_tag)

    # the connection
    def drain_events(self, timeout: float | None = None) -> None:
        for tag in self._unconfirmed:
            index = self.publisher._outstanding[tag]
            cid = self.publisher_messages[index].properties["correlation_id"]
            if self.sent.count(cid) <= self.nacks:
                self.publisher._on_nack(tag, False)
            else:
                self.publisher._on_ack(tag, False)
        self._unconfirmed.clear()

    publisher_messages: list[TaskMessage] = []


def _publisher(timeout_s: float) -> tuple[KombuPublisher, list[TaskMessage]]:
    settings = Settings(namespace="ns", routes={"E": ("a",)}, relay_publish_timeout_s=timeout_s)
    publisher = KombuPublisher(broker_url="amqp://guest:guest@127.0.0.1:1//", settings=settings)
    messages = [celery_task_message(Envelope(message_id=uuid.uuid4(), type="E", payload={}), consumer="a",
                                    routing_key="ns.a") for _ in range(3)]
    return publisher, messages


def _wire(publisher: KombuPublisher, messages: list[TaskMessage], *, nacks: int) -> Broker:
    broker = Broker(publisher, nacks=nacks)
    broker.publisher_messages = messages
    publisher._conn = broker
    publisher._producer = broker
    for i, m in enumerate(messages):  # what ``_send`` does, without a socket
        publisher._publish_one(broker, i, m, confirm=True)
    return broker


def test_a_nacked_message_is_sent_again_and_confirmed() -> None:
    # Given a batch of three whose every message the broker nacks once (a quorum queue electing a leader)
    publisher, messages = _publisher(timeout_s=5.0)
    broker = _wire(publisher, messages, nacks=1)
    # When the publisher waits for the confirms
    report = publisher._await(messages)
    # Then each nacked message was sent once more, all are confirmed, none is reported rejected
    assert not report.rejected and report.count == 3
    assert publisher.nacks_resent == 3
    assert sorted(broker.sent) == sorted(2 * [m.properties["correlation_id"] for m in messages])


def test_nacks_past_the_timeout_fail_the_batch_as_broker_unavailable() -> None:
    # Given a queue that nacks everything (no leader for longer than the publish timeout)
    publisher, messages = _publisher(timeout_s=0.5)
    _wire(publisher, messages, nacks=10_000)
    # When the publisher waits, then the batch fails as a relay-wide condition, not as rejected rows
    with pytest.raises(BrokerUnavailableError, match="nacked 3 message"):
        publisher._await(messages)
