"""The cluster harness itself, and the quorum-queue behaviour the library's settings rely on.

Real RabbitMQ nodes (chaos/cluster.py), never the shared server on 5672.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from kombu import Connection, Exchange, Queue

from celery_outbox.celery.config import quorum_delivery_limit
from celery_outbox.celery.kombu_publisher import KombuPublisher
from celery_outbox.messages import Envelope, celery_task_message
from celery_outbox.settings import Settings
from chaos.cluster import RabbitCluster

pytestmark = [pytest.mark.cluster, pytest.mark.rabbitmq, pytest.mark.slow]


def test_three_nodes_of_their_own(rabbit_cluster: RabbitCluster) -> None:
    """Given the session's cluster, then three running members, each on its own port, none the shared node."""
    running = rabbit_cluster.running_nodes()
    assert sorted(running) == sorted(n.name for n in rabbit_cluster.nodes)
    assert len({n.port for n in rabbit_cluster.nodes}) == 3
    assert 5672 not in {n.port for n in rabbit_cluster.nodes}
    assert all(n.name.startswith(rabbit_cluster.tag) for n in rabbit_cluster.nodes)
    assert not any(name.startswith("rabbit@") for name in running)
    for node in rabbit_cluster.nodes:  # each node's data lives under the cluster's work directory
        assert Path(node.base, "mnesia").is_dir()
        with Connection(node.url, connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=1)


def _envelope() -> Envelope:
    return Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload={"n": 1}, headers={}, created_at_ms=0)


def test_quorum_queue_keeps_confirmed_messages_when_its_leader_dies(rabbit_cluster: RabbitCluster) -> None:
    """Given 50 messages published with confirms to the library's quorum queue, when the queue's leader
    node is SIGKILLed, then all 50 are consumed through a surviving node (and the node comes back)."""
    ns = f"qq{uuid.uuid4().hex[:8]}"
    settings = Settings(namespace=ns, broker_queue_type="quorum", routes={"OrderPlaced": ("shipping",)})
    name = settings.queue_name("shipping")
    messages = [celery_task_message(_envelope(), consumer="shipping", routing_key=name) for _ in range(50)]
    dead = None
    try:
        with KombuPublisher(broker_url=rabbit_cluster.url, settings=settings) as publisher:
            report = publisher.publish_batch(messages)
        assert report.count == 50 and not report.rejected
        with Connection(rabbit_cluster.url, connect_timeout=5) as conn:
            _, count, _ = Queue(name, channel=conn.channel()).queue_declare(passive=True)
        info = rabbit_cluster.queue_info([name], ("name", "type", "leader", "members"))[name].split("\t")
        qtype, leader, members = info[0], info[1], info[2]
        assert qtype == "quorum" and count == 50
        assert all(n.name in members for n in rabbit_cluster.nodes)
        dead = next(n for n in rabbit_cluster.nodes if n.name == leader)

        rabbit_cluster.kill_node(dead.index)
        survivors = [n for n in rabbit_cluster.nodes if n is not dead]
        got: list[str] = []
        with Connection(";".join(n.url for n in survivors), connect_timeout=5) as conn:
            queue = Queue(name, channel=conn.channel())
            deadline = time.monotonic() + 60
            while len(got) < 50 and time.monotonic() < deadline:
                try:
                    msg = queue.get(no_ack=False)
                except Exception:  # the queue may answer only once a new leader is elected
                    time.sleep(0.2)
                    conn.close()
                    conn.ensure_connection(max_retries=3)
                    queue = Queue(name, channel=conn.channel())
                    continue
                if msg is None:
                    time.sleep(0.1)
                    continue
                got.append(str(msg.properties.get("correlation_id")))
                msg.ack()
        assert sorted(got) == sorted(str(m.properties["correlation_id"]) for m in messages)
    finally:
        if dead is not None:
            rabbit_cluster.start_node(dead.index)
        rabbit_cluster.delete_queues([name, f"{ns}.relay"], exchanges=(f"{ns}.events", f"{ns}.relay"))


def test_broker_drops_a_message_returned_more_than_its_delivery_limit(rabbit_cluster: RabbitCluster) -> None:
    """The broker's poison guard, measured: with ``x-delivery-limit`` L a message is delivered L + 1 times
    (returned with requeue each time) and then dropped, with no dead-letter exchange. So the library's
    limit (``quorum_delivery_limit``) must stay above its own count of deliveries, which it does."""
    limit = 2
    name = f"qq-limit-{uuid.uuid4().hex[:8]}"
    deliveries = 0
    with Connection(rabbit_cluster.url, connect_timeout=5) as conn:
        channel = conn.channel()
        queue = Queue(name, Exchange(""), routing_key=name, durable=True,
                      queue_arguments={"x-queue-type": "quorum", "x-delivery-limit": limit})(channel)
        queue.declare()
        try:
            channel.basic_publish(channel.prepare_message(b"poison"), exchange="", routing_key=name)
            idle_since = time.monotonic()
            while time.monotonic() - idle_since < 3:  # nothing for 3 s: the broker let go of it
                msg = queue.get(no_ack=False)
                if msg is None:
                    time.sleep(0.05)
                    continue
                deliveries += 1
                idle_since = time.monotonic()
                msg.reject(requeue=True)
            _, remaining, _ = queue.queue_declare(passive=True)
        finally:
            queue.delete()
    assert deliveries == limit + 1
    assert remaining == 0
    settings = Settings(consumer_max_deliveries=3)
    assert quorum_delivery_limit(settings) + 1 > settings.consumer_max_deliveries + 1
