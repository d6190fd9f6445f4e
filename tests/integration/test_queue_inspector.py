"""The reconciler's queue probe on real brokers: what waits, what a worker holds unacknowledged, who listens."""

from __future__ import annotations

import uuid

import pytest
from kombu import Connection, Consumer, Exchange, Queue

from celery_outbox.celery.queue_inspector import KombuQueueInspector

pytestmark = pytest.mark.slow


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url


def test_waiting_and_taken_messages_are_reported_and_an_undeclared_queue_holds_nothing(broker_url: str) -> None:
    name = f"qi-{uuid.uuid4().hex[:8]}"
    exchange = Exchange(name, type="direct", durable=True)
    queue = Queue(name, exchange, routing_key=name, durable=True)
    ids = [str(uuid.uuid4()) for _ in range(3)]
    with Connection(broker_url) as conn:
        channel = conn.channel()
        queue(channel).declare()
        producer = conn.Producer(channel, exchange=exchange)
        for mid in ids:
            producer.publish({"n": 1}, routing_key=name, headers={"id": mid}, delivery_mode=2)
        try:
            # Given three messages published to a queue and one of them taken by a consumer that has not acked it
            consumer_channel = conn.channel()
            consumer_channel.basic_qos(0, 1, False)
            taken: list[str] = []
            with Consumer(consumer_channel, queues=[queue], callbacks=[lambda body, m: taken.append(
                    m.headers["id"])], accept=["json"]):
                conn.drain_events(timeout=5)
                # When the reconciler asks the broker about it and about a queue never declared
                states = KombuQueueInspector(broker_url=broker_url).queue_states([name, f"{name}-none"])
            assert taken == [ids[0]]
        finally:
            queue(conn.channel()).delete()
    # Then two wait; Redis lists the taken one's id (kombu's unacked hash), RabbitMQ counts the consumer
    state = states[name]
    assert state.ready == 2
    if broker_url.startswith("redis"):
        assert state.unacked is not None and ids[0] in state.unacked and ids[1] not in state.unacked
        assert state.consumers is None
    else:
        assert state.unacked is None and state.consumers == 1
    assert states[f"{name}-none"].ready == 0
    assert state.holds_no_copy_of(ids[0]) is False
