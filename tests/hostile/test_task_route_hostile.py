"""Task options whose route or message properties no broker client encodes (a priority past an octet or not an
integer, text past AMQP's 255-byte short string, a timestamp that is no integer) or that no database column stores
(NUL in a property): refused by ``outbox.enqueue`` / ``delay()`` with a ``ValidationError``, nothing written and
the caller's transaction intact; a row already stored with them (an older release, another writer) is
dead-lettered by the relay as unpublishable, and the rows behind it are published. Before, enqueue stored them,
and on RabbitMQ py-amqp's encoding error failed every relay batch holding the row: nothing behind it went out."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from kombu import Connection, Exchange, Queue
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Outbox, Settings
from celery_outbox.celery.kombu_publisher import KombuPublisher
from celery_outbox.clock import ManualClock
from celery_outbox.errors import ValidationError
from celery_outbox.relay.dispatch import dispatch_with_settings
from celery_outbox.schema import Tables

HOSTILE_OPTIONS = [
    pytest.param({"priority": "high"}, "priority", id="priority-text"),
    pytest.param({"priority": 300}, "priority", id="priority-past-an-octet"),
    pytest.param({"priority": -1}, "priority", id="priority-negative"),
    pytest.param({"priority": True}, "priority", id="priority-bool"),
    pytest.param({"correlation_id": "c" * 256}, "correlation_id", id="correlation-id-256-bytes"),
    pytest.param({"reply_to": "é" * 128}, "reply_to", id="reply-to-256-utf8-bytes"),
    pytest.param({"app_id": "a\x00"}, "NUL", id="app-id-nul"),
    pytest.param({"reply_to": "r\ud800"}, "lone surrogate", id="reply-to-surrogate"),
    pytest.param({"timestamp": "now"}, "timestamp", id="timestamp-text"),
    pytest.param({"timestamp": 1.5}, "timestamp", id="timestamp-float"),
    pytest.param({"queue": "q" * 256}, "256 bytes", id="queue-name-256-bytes"),
    pytest.param({"queue": 5}, "queue declaration", id="queue-name-int"),
    pytest.param({"expiration": -5}, "expiration", id="expiration-negative"),
    pytest.param({"queue": Queue("q-own", Exchange("x-own", type="bogus"))}, "exchange type 'bogus'",
                 id="exchange-type-unknown"),
    pytest.param({"expiration": "soon"}, "expiration", id="expiration-text"),
]


def _outbox(engine: sa.Engine, queue: str, broker: str = "memory://") -> tuple[Outbox, Any]:
    app = Celery("t", broker=broker, set_as_current=False)
    app.conf.task_default_queue = queue
    outbox = Outbox(app, engine=engine, settings=Settings(), clock=ManualClock())

    @app.task(name="hostile.plain", shared=False)  # type: ignore[untyped-decorator]
    def plain(*args: Any, **kwargs: Any) -> None:
        """A plain task the outbox captures."""

    return outbox, plain


def _rows(engine: sa.Engine, tables: Tables) -> int:
    with engine.connect() as c:
        return int(c.scalar(sa.select(sa.func.count()).select_from(tables.table(tables.outbox))) or 0)


@pytest.mark.parametrize(("options", "said"), HOSTILE_OPTIONS)
def test_enqueue_refuses_what_no_broker_or_column_takes(any_db_url: str, tables: Tables, namespace: str,
                                                        options: dict[str, Any], said: str) -> None:
    engine = sa.create_engine(any_db_url)
    outbox, plain = _outbox(engine, f"{namespace}_tasks")
    sessions = sessionmaker(engine)
    try:
        with sessions() as s:
            # Given the caller's own write in its transaction
            s.execute(sa.insert(tables.table(tables.outbox)), [{
                "message_id": uuid.uuid4(), "type": "Own", "payload": {}, "headers": {}, "created_at_ms": 0,
                "next_attempt_at_ms": 0, "attempts": 0}])
            # When a task is enqueued with an option no broker client encodes or no column stores
            with pytest.raises(ValidationError, match=said) as e:
                outbox.enqueue(s, plain.s(1), **options)
            # Then it is refused in one line saying so, and the caller's transaction still commits its own write
            assert "nothing was written" in str(e.value) and "\n" not in str(e.value)
            s.commit()
        assert _rows(engine, tables) == 1
    finally:
        engine.dispose()


def test_enqueue_keeps_what_every_broker_takes(sqlite_url: str, tables: Tables, namespace: str) -> None:
    # Given options at the edges of what the brokers take; When enqueued; Then each is written
    engine = sa.create_engine(sqlite_url)
    outbox, plain = _outbox(engine, f"{namespace}_tasks")
    with sessionmaker(engine)() as s:
        for options in ({"priority": 0}, {"priority": 255}, {"correlation_id": "c" * 255}, {"timestamp": 1_700_000_000},
                        {"expires": 30}, {"queue": "q" * 255}):
            outbox.enqueue(s, plain.s(1), **options)
        s.commit()
    assert _rows(engine, tables) == 6
    engine.dispose()


@pytest.fixture
def task_queue(rabbitmq_url: str, namespace: str) -> Iterator[str]:
    name = f"{namespace}_tasks"
    yield name
    with Connection(rabbitmq_url) as conn, contextlib.suppress(Exception):
        Queue(name, no_declare=True)(conn.channel()).delete()


@pytest.mark.rabbitmq
@pytest.mark.parametrize("properties", [{"priority": "high"}, {"priority": 300}, {"correlation_id": "c" * 300},
                                        {"timestamp": "now"}, {"exchange_type": "bogus"},
                                        {"task_headers": {"note": "x" * 150_000}}])
def test_a_stored_row_no_broker_encodes_is_dead_lettered_and_the_rows_behind_it_go_out(
        rabbitmq_url: str, sqlite_url: str, tables: Tables, namespace: str, task_queue: str,
        properties: dict[str, Any]) -> None:
    engine = sa.create_engine(sqlite_url)
    outbox, plain = _outbox(engine, task_queue, broker=rabbitmq_url)
    sessions: sessionmaker[Session] = sessionmaker(engine)
    with sessions() as s:
        bad, good = outbox.enqueue(s, plain.s(1)), outbox.enqueue(s, plain.s(2))
        s.commit()
    # Given a task row stored with a property no broker client encodes (written by an older release or another
    # writer), ahead of a good one
    o = tables.outbox
    with sessions() as s:
        row = s.execute(sa.select(o).where(o.message_id == uuid.UUID(bad.id))).scalar_one()
        headers = dict(row.headers)
        if "exchange_type" in properties:  # the task's queue declaration, not a message property
            headers["queue"] = {**headers["queue"], "exchange": "x-own", **properties}
        elif "task_headers" in properties:  # the message's headers, past one AMQP frame
            headers["task_headers"] = {**headers["task_headers"], **properties["task_headers"]}
        else:
            headers["properties"] = {**headers["properties"], **properties}
        s.execute(sa.update(tables.table(o)).where(tables.table(o).c.message_id == uuid.UUID(bad.id))
                  .values(headers=headers))
        s.commit()
    # When the relay sends a batch to RabbitMQ
    settings = Settings(namespace=namespace, broker_url=rabbitmq_url)
    with KombuPublisher(broker_url=rabbitmq_url, settings=settings) as pub, sessions() as s:
        result = dispatch_with_settings(s, pub, ManualClock(), settings, tables=tables)
    # Then the bad row is dead-lettered as unpublishable, saying which property (headers past one frame: not sent,
    # charged an attempt, as the publisher finds them), and the good one is published
    dead = 0 if "task_headers" in properties else 1
    assert (result.broker_unavailable, result.published, result.dead_lettered, result.failed) == (
        False, 1, dead, 1 - dead), result
    with sessions() as s:
        states = {str(r.message_id): (r.published_at_ms is not None, r.last_error) for r in s.scalars(sa.select(o))}
    assert states[good.id] == (True, None)
    said = "message headers" if "task_headers" in properties else next(iter(properties))
    assert states[bad.id][0] is False and (said in str(states[bad.id][1]) or said.replace("_", " ") in str(states[bad.id][1]))
    with Connection(rabbitmq_url) as conn:
        got = Queue(task_queue, no_declare=True)(conn.channel()).get(no_ack=True)
    assert got is not None and got.headers["id"] == good.id
    engine.dispose()


@pytest.mark.rabbitmq
@pytest.mark.parametrize("mode", ["confirm", "tx", "none"])
def test_a_task_the_broker_would_refuse_for_the_channel_is_charged_to_its_row_not_to_the_broker(
        rabbitmq_url: str, sqlite_url: str, tables: Tables, namespace: str, task_queue: str, mode: str) -> None:
    engine = sa.create_engine(sqlite_url)
    outbox, plain = _outbox(engine, task_queue, broker=rabbitmq_url)
    # Given a task routed to an exchange nothing declares (task_routes naming no queue), one carrying a user_id
    # that is not the relay's broker user (RabbitMQ closes the channel for either), then a good one
    outbox.app.conf.task_routes = {"hostile.elsewhere": {"exchange": f"{namespace}_missing", "routing_key": "x"}}

    @outbox.app.task(name="hostile.elsewhere", shared=False)  # type: ignore[untyped-decorator]
    def elsewhere() -> None:
        """Routed to an exchange that does not exist."""

    sessions: sessionmaker[Session] = sessionmaker(engine)
    with sessions() as s:
        missing = outbox.enqueue(s, elsewhere.s())
        other_user = outbox.enqueue(s, plain.s(1), user_id="nobody")
        good = outbox.enqueue(s, plain.s(2))
        s.commit()
    # When the relay sends a batch to RabbitMQ, twice
    settings = Settings(namespace=namespace, broker_url=rabbitmq_url, relay_confirm_mode=mode)
    with KombuPublisher(broker_url=rabbitmq_url, settings=settings) as pub:
        with sessions() as s:
            first = dispatch_with_settings(s, pub, ManualClock(), settings, tables=tables)
        # Then the broker is not taken for down: the good row is published, each bad one is charged an attempt
        # saying why (retried with backoff, dead-lettered at max_attempts like any message the broker refuses)
        assert (first.broker_unavailable, first.published, first.failed) == (False, 1, 2), first
        with sessions() as s:
            later = dispatch_with_settings(s, pub, ManualClock(), settings, tables=tables)
        assert pub.connections_opened == 1 and not later.broker_unavailable
    o = tables.outbox
    with sessions() as s:
        rows = {str(r.message_id): r for r in s.scalars(sa.select(o))}
    assert rows[good.id].published_at_ms is not None
    assert rows[missing.id].attempts == 1 and f"{namespace}_missing" in str(rows[missing.id].last_error)
    assert rows[other_user.id].attempts == 1 and "user_id" in str(rows[other_user.id].last_error)
    engine.dispose()


@pytest.mark.rabbitmq
def test_a_queue_declaration_the_broker_refuses_is_charged_to_its_row_not_to_the_broker(
        rabbitmq_url: str, sqlite_url: str, tables: Tables, namespace: str, task_queue: str) -> None:
    engine = sa.create_engine(sqlite_url)
    outbox, plain = _outbox(engine, task_queue, broker=rabbitmq_url)
    sessions: sessionmaker[Session] = sessionmaker(engine)
    # Given the task queue as the workers declared it, and a task given its own declaration of that queue with
    # other arguments (RabbitMQ answers PRECONDITION_FAILED and closes the channel), ahead of a good task
    with Connection(rabbitmq_url) as conn:
        Queue(task_queue, durable=True)(conn.channel()).declare()
    with sessions() as s:
        clash = outbox.enqueue(s, plain.s(1), queue=Queue(task_queue, durable=True, max_priority=10))
        good = outbox.enqueue(s, plain.s(2))
        s.commit()
    # When the relay sends a batch
    settings = Settings(namespace=namespace, broker_url=rabbitmq_url)
    with KombuPublisher(broker_url=rabbitmq_url, settings=settings) as pub, sessions() as s:
        result = dispatch_with_settings(s, pub, ManualClock(), settings, tables=tables)
    # Then the broker is not taken for down: the good task is published, the clashing one charged an attempt
    assert (result.broker_unavailable, result.published, result.failed) == (False, 1, 1), result
    o = tables.outbox
    with sessions() as s:
        rows = {str(r.message_id): r for r in s.scalars(sa.select(o))}
    assert rows[good.id].published_at_ms is not None
    assert rows[clash.id].attempts == 1 and "PRECONDITION_FAILED" in str(rows[clash.id].last_error)
    engine.dispose()


@pytest.mark.redis
def test_on_redis_a_queue_exchange_type_kombu_lacks_is_charged_to_its_row_not_to_the_broker(
        redis_url: str, sqlite_url: str, tables: Tables, namespace: str) -> None:
    engine = sa.create_engine(sqlite_url)
    queue = f"{namespace}_tasks"
    outbox, plain = _outbox(engine, queue, broker=redis_url)
    sessions: sessionmaker[Session] = sessionmaker(engine)
    # Given a task whose own queue declaration names a headers exchange (RabbitMQ has it, kombu's Redis transport
    # does not: its KeyError read as an outage on every batch), ahead of a good task
    with sessions() as s:
        other = outbox.enqueue(s, plain.s(1), queue=Queue(f"{namespace}_h", Exchange(f"{namespace}_hx", type="headers")))
        good = outbox.enqueue(s, plain.s(2))
        s.commit()
    # When the relay sends a batch to Redis
    settings = Settings(namespace=namespace, broker_url=redis_url)
    try:
        with KombuPublisher(broker_url=redis_url, settings=settings) as pub, sessions() as s:
            result = dispatch_with_settings(s, pub, ManualClock(), settings, tables=tables)
        # Then the broker is not taken for down: the good task is published, the other charged an attempt saying why
        assert (result.broker_unavailable, result.published, result.failed) == (False, 1, 1), result
        with sessions() as s:
            rows = {str(r.message_id): r for r in s.scalars(sa.select(tables.outbox))}
        assert rows[good.id].published_at_ms is not None
        assert rows[other.id].attempts == 1 and "exchange type 'headers'" in str(rows[other.id].last_error)
    finally:
        with Connection(redis_url) as conn, contextlib.suppress(Exception):
            Queue(queue, no_declare=True)(conn.channel()).delete()
        engine.dispose()


@pytest.mark.parametrize("header", ["x" * 70_000, "é" * 40_000])
def test_task_headers_past_one_broker_frame_are_refused_at_enqueue(sqlite_url: str, tables: Tables, namespace: str,
                                                                   header: str) -> None:
    # Given a task sent with a header larger than one AMQP frame holds (RabbitMQ closed the relay's connection with
    # FRAME_ERROR on every batch holding such a row, so nothing behind it was published)
    engine = sa.create_engine(sqlite_url)
    outbox, plain = _outbox(engine, f"{namespace}_tasks")
    with sessionmaker(engine)() as s:
        # When it is enqueued; Then it is refused, nothing written; a header within the bound is kept
        with pytest.raises(ValidationError, match="over the 65536 one broker frame holds"):
            outbox.enqueue(s, plain.s(1), headers={"note": header})
        outbox.enqueue(s, plain.s(1), headers={"note": header[:20_000]})
        s.commit()
    assert _rows(engine, tables) == 1
    engine.dispose()
