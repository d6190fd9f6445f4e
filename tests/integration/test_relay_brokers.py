"""dispatch_batch + KombuPublisher against the real Redis and RabbitMQ: Celery task messages in every
consumer queue; on RabbitMQ confirms/tx per batch and mandatory publishing that reports unroutables."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator

import pytest
from kombu import Connection, Exchange, Queue
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.celery.kombu_publisher import KombuPublisher
from celery_outbox.clock import ManualClock
from celery_outbox.messages import Envelope, celery_task_message
from celery_outbox.relay.dispatch import dispatch_with_settings
from celeryconfig import Settings
from tests.outbox_rows import insert_pending


def insert(sessions: sessionmaker[Session], clock: ManualClock, n: int, tables: Tables) -> set[str]:
    return {str(i) for i in insert_pending(sessions, clock.now_ms(), n, tables=tables,
                                           payload=lambda i, mid: {"order_id": str(mid)})}


def consume_all(url: str, queue_name: str) -> list[tuple[dict[str, object], dict[str, object], str]]:
    out = []
    with Connection(url) as conn:
        queue = Queue(queue_name, no_declare=True)(conn.channel())
        while (msg := queue.get(no_ack=False)) is not None:
            out.append((dict(msg.headers), dict(msg.properties), msg.body.decode()
                        if isinstance(msg.body, bytes) else msg.body))
            msg.ack()
    return out


@pytest.fixture
def cleanup(namespace: str) -> Iterator[list[tuple[str, Settings]]]:
    todo: list[tuple[str, Settings]] = []
    yield todo
    for url, settings in todo:
        with Connection(url) as conn:
            ch = conn.channel()
            for c in (*settings.consumers, "nobody"):
                try:
                    Queue(settings.queue_name(c), no_declare=True)(ch).delete()
                except Exception:
                    ch = conn.channel()
            with contextlib.suppress(Exception):
                Exchange(settings.exchange_name)(ch).delete()


def check_celery_messages(url: str, settings: Settings, ids: set[str]) -> None:
    task_ids: set[str] = set()
    for consumer in settings.consumers:
        got = consume_all(url, settings.queue_name(consumer))
        assert len(got) == len(ids), (consumer, got)
        for headers, props, body in got:
            mid = str(headers["outbox_message_id"])
            assert headers["task"] == f"consumers.{consumer}"
            tid = str(headers["id"])
            assert tid == str(uuid.UUID(tid)) == headers["root_id"] == props["correlation_id"]
            task_ids.add(tid)
            assert props.get("delivery_mode") == 2
            args, kwargs, embed = json.loads(body)
            assert kwargs == {} and set(embed) >= {"callbacks", "errbacks", "chain", "chord"}
            envelope = Envelope.from_dict(args[0])
            assert envelope.type == "OrderPlaced" and envelope.payload == {"order_id": mid}
        assert {str(h["outbox_message_id"]) for h, _, _ in got} == ids
    assert len(task_ids) == len(ids) * len(settings.consumers)  # one task id per publish, never shared


@pytest.mark.redis
def test_redis_every_consumer_queue_gets_a_celery_task_message(
        redis_url: str, namespace: str, tmp_home: object, sqlite_sessions: sessionmaker[Session],
        clock: ManualClock, cleanup: list[tuple[str, Settings]], tables: Tables) -> None:
    settings = Settings(namespace=namespace, broker_url=redis_url)
    cleanup.append((redis_url, settings))
    ids = insert(sqlite_sessions, clock, 5, tables)
    with KombuPublisher(broker_url=redis_url, settings=settings) as pub, sqlite_sessions() as s:
        result = dispatch_with_settings(s, pub, clock, settings, tables=tables)
    assert (result.published, result.messages_sent) == (5, 5 * len(settings.consumers))
    check_celery_messages(redis_url, settings, ids)


@pytest.mark.rabbitmq
@pytest.mark.parametrize("mode", ["confirm", "tx", "none"])
def test_rabbitmq_every_consumer_queue_gets_a_celery_task_message(
        rabbitmq_url: str, namespace: str, sqlite_sessions: sessionmaker[Session], clock: ManualClock,
        cleanup: list[tuple[str, Settings]], mode: str, tables: Tables) -> None:
    settings = Settings(namespace=namespace, broker_url=rabbitmq_url, relay_confirm_mode=mode,
                        relay_batch_size=4)
    cleanup.append((rabbitmq_url, settings))
    ids = insert(sqlite_sessions, clock, 10, tables)
    with KombuPublisher(broker_url=rabbitmq_url, settings=settings) as pub:
        total = 0
        for _ in range(4):
            with sqlite_sessions() as s:
                total += dispatch_with_settings(s, pub, clock, settings, tables=tables).published
        assert pub.connections_opened == 1
    assert total == 10
    check_celery_messages(rabbitmq_url, settings, ids)


@pytest.mark.rabbitmq
@pytest.mark.parametrize("mode", ["confirm", "tx"])
def test_rabbitmq_unroutable_message_is_reported_rejected_not_confirmed(
        rabbitmq_url: str, namespace: str, cleanup: list[tuple[str, Settings]], mode: str) -> None:
    # Given a batch with one message for a queue that does not exist between two good ones
    settings = Settings(namespace=namespace, broker_url=rabbitmq_url, relay_confirm_mode=mode)
    cleanup.append((rabbitmq_url, settings))
    msgs = [celery_task_message(Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload={}),
                                consumer=c, routing_key=settings.queue_name(c))
            for c in ("shipping", "nobody", "billing")]
    with KombuPublisher(broker_url=rabbitmq_url, settings=settings) as pub:
        report = pub.publish_batch(msgs)
        # And the channel stays usable for the next batch
        again = pub.publish_batch(msgs[:1])
    # Then the broker's return is reported against exactly that message
    assert report.confirmed == (0, 2)
    assert set(report.rejected) == {1} and "unroutable" in report.rejected[1]
    assert again.confirmed == (0,)
    assert len(consume_all(rabbitmq_url, settings.queue_name("shipping"))) == 2


@pytest.mark.rabbitmq
def test_rabbitmq_a_batch_larger_than_one_socket_write_is_confirmed_whole_with_unroutables_reported(
        rabbitmq_url: str, namespace: str, cleanup: list[tuple[str, Settings]]) -> None:
    from celery_outbox.celery.kombu_publisher import WRITE_CHUNK

    # Given one batch several times larger than the publisher's collected write, with an unroutable
    # message near the end (its return and the acks arrive while the batch is still being written)
    settings = Settings(namespace=namespace, broker_url=rabbitmq_url, routes={"OrderPlaced": ("shipping",)})
    cleanup.append((rabbitmq_url, settings))
    msgs = [celery_task_message(Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload={"pad": "x" * 500}),
                                consumer="shipping", routing_key=settings.queue_name("shipping"))
            for _ in range(3000)]
    msgs[2900] = celery_task_message(Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload={}),
                                     consumer="nobody", routing_key=settings.queue_name("nobody"))
    assert sum(len(m.body) for m in msgs) > 4 * WRITE_CHUNK
    with KombuPublisher(broker_url=rabbitmq_url, settings=settings) as pub:
        # When it is sent ahead and then awaited
        wait = pub.send_batch(msgs)
        report = wait()
        # And the connection serves the next batch
        again = pub.publish_batch(msgs[:2])
    # Then every message is confirmed but the unroutable one, which is reported against its index
    assert set(report.rejected) == {2900} and "unroutable" in report.rejected[2900]
    assert len(report.confirmed) == 2999 and again.confirmed == (0, 1)
    assert len(consume_all(rabbitmq_url, settings.queue_name("shipping"))) == 3001
