"""The worker's task events (what Flower shows) leave without waiting for publisher confirms
(celery_outbox/celery/events.py, ``UnconfirmedTaskEvents``), and still arrive. Real RabbitMQ and Redis."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue

from celery_outbox.celery import events
from celeryconfig import Settings, celery_config


def _app(settings: Settings, broker_url: str) -> Celery:
    app = Celery("t", set_as_current=False)
    app.conf.update(celery_config(settings, broker_url))
    return app


def _worker_consumer(app: Celery) -> Any:
    """What Celery's ``Events`` consumer step leaves on a worker consumer: its own dispatcher, enabled."""
    conn = app.connection_for_write()
    conn.ensure_connection(max_retries=1)
    dispatcher = app.events.Dispatcher(conn, hostname=f"w-{uuid.uuid4().hex[:6]}@test", enabled=True)
    return SimpleNamespace(app=app, event_dispatcher=dispatcher, amqheartbeat=None,
                           ensure_connected=lambda c: c.ensure_connection(max_retries=1) and c)


@pytest.mark.rabbitmq
def test_rabbitmq_task_events_leave_without_confirms_and_arrive(settings: Settings, rabbitmq_url: str) -> None:
    # Given a worker consumer of an app with publisher confirms (the recommended RabbitMQ configuration)
    app = _app(settings, rabbitmq_url)
    assert app.conf.broker_transport_options.get("confirm_publish") is True
    consumer = _worker_consumer(app)
    dispatcher = consumer.event_dispatcher
    old = dispatcher.connection
    assert dispatcher.producer.channel.connection.confirm_publish is True
    marker = uuid.uuid4().hex
    queue = Queue(f"t-events-{marker}", Exchange(app.conf.event_exchange, type="topic"), routing_key="task.#",
                  auto_delete=True)
    with Connection(rabbitmq_url) as listen:
        bound = queue(listen.default_channel)
        bound.declare()
        try:
            # When the outbox's consumer step runs
            assert events.without_confirms(consumer) is True
            # Then the same dispatcher publishes on a connection without confirms, the old one is closed
            assert consumer.event_dispatcher is dispatcher
            assert dispatcher.producer.channel.connection.confirm_publish is False
            assert not old.connected
            # And a task event still reaches a receiver (Flower)
            dispatcher.send("task-succeeded", uuid=marker, result="'processed'", runtime=0.01)
            message = None
            for _ in range(50):
                message = bound.get(no_ack=True)
                if message is not None:
                    break
                time.sleep(0.1)  # a wait for the broker, not a timing check
            assert message is not None, "no task event arrived"
            body = message.decode()
            assert (body["type"], body["uuid"], body["hostname"]) == ("task-succeeded", marker, dispatcher.hostname)
        finally:
            bound.delete()
            dispatcher.close()
            dispatcher.connection.close()


@pytest.mark.redis
def test_redis_and_disabled_dispatchers_are_left_as_they_are(settings: Settings, redis_url: str) -> None:
    # Given a worker consumer on Redis (no publisher confirms to avoid)
    consumer = _worker_consumer(_app(settings, redis_url))
    dispatcher = consumer.event_dispatcher
    before = (dispatcher.connection, dispatcher.producer)
    try:
        # When the step runs, Then nothing changes
        assert events.without_confirms(consumer) is False
        assert (dispatcher.connection, dispatcher.producer) == before
        # And a consumer without events (worker_send_task_events off, ``-E`` not given) is left alone too
        assert events.without_confirms(SimpleNamespace(event_dispatcher=None)) is False
    finally:
        dispatcher.close()
        dispatcher.connection.close()


def test_an_outbox_worker_runs_the_step() -> None:
    from celery_outbox import Outbox

    app = Celery("t", set_as_current=False)
    Outbox(app, settings=Settings(database_url="sqlite://"))
    assert events.UnconfirmedTaskEvents in app.steps["consumer"]
