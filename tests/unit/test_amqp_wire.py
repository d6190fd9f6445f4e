"""The relay's lean publish (celery/amqp_wire.py) puts the same bytes on the wire as kombu's ``Producer.publish``.

Both paths publish into a stand-in py-amqp channel that records what ``basic_publish`` received; the header
frame's properties are then encoded by py-amqp's own encoder (kombu's message) and by ``LeanMessage``, and
the body, exchange, routing key and mandatory flag compared.
"""

from __future__ import annotations

import datetime
import uuid
from decimal import Decimal
from typing import Any

import amqp
import pytest
from kombu.transport.pyamqp import Channel as PyAmqpChannel

from celery_outbox.celery.amqp_wire import LeanMessage, encode_properties
from celery_outbox.celery.kombu_publisher import KombuPublisher
from celery_outbox.messages import Envelope, QueueSpec, TaskMessage, celery_task_messages, task_row_message
from celery_outbox.settings import Settings


class Recorder:
    """The channel side of a publish: what ``basic_publish`` got."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, dict[str, Any]]] = []
        self.events: dict[str, set[Any]] = {"basic_return": set()}

    prepare_message = PyAmqpChannel.prepare_message

    def basic_publish(self, message: Any, **kw: Any) -> None:
        defaults = {"immediate": False, "timeout": None, "confirm_timeout": None}
        self.sent.append((message, {**defaults, **kw}))


def _publisher() -> KombuPublisher:
    settings = Settings(namespace="ns", routes={"OrderPlaced": ("a", "b", "c")})
    return KombuPublisher(broker_url="amqp://guest:guest@127.0.0.1:1//", settings=settings)


def _messages() -> list[TaskMessage]:
    env = Envelope(message_id=uuid.uuid4(), type="OrderPlaced",
                   payload={"order": "o-1", "total": 12.5, "items": [1, 2, {"x": None}], "ok": True, "é": "ü"},
                   headers={"trace": "t"}, created_at_ms=1_700_000_000_000)
    events = celery_task_messages(env, targets=[(c, f"ns.{c}") for c in ("a", "b", "c")])
    tid = str(uuid.uuid4())
    task_headers = {"lang": "py", "task": "orders.email", "id": tid, "root_id": tid, "parent_id": None,
                    "group": None, "retries": 0, "eta": None, "expires": None, "timelimit": [None, None],
                    "argsrepr": "('o-1',)", "kwargsrepr": "{}", "origin": "gen1@host", "ignore_result": False,
                    "big": 2**40, "neg": -5}
    queue = {"name": "email", "exchange": "email", "exchange_type": "direct", "routing_key": "email"}
    tasks = [task_row_message(message_id=tid, type="orders.email", payload={"body": [["o-1"], {}, None]},
                              headers={"task_headers": task_headers, "exchange": exchange, "routing_key": "email",
                                       "queue": queue, "properties": props, "delivery_mode": mode})
             for exchange, props, mode in (("email", {"reply_to": "r"}, 2), ("", {}, 1),
                                           ("email", {"priority": 3, "reply_to": "r"}, 2))]
    return [*events, *tasks]


def _publish(*, lean: bool, messages: list[TaskMessage]) -> list[tuple[Any, dict[str, Any]]]:
    from kombu import Producer

    publisher, channel = _publisher(), Recorder()
    publisher._producer = Producer(channel, exchange=publisher.exchange, auto_declare=False)
    publisher._task_producer = Producer(channel, auto_declare=False)
    publisher._lean = channel if lean else None
    for i, m in enumerate(messages):
        publisher._publish_one(publisher._producer, i, m, confirm=True)
    return channel.sent


def test_the_lean_publish_writes_what_kombu_writes() -> None:
    # Given events and tasks (default exchange, a named one, one property kombu rewrites)
    messages = _messages()
    # When both paths publish them
    kombu_sent, lean_sent = _publish(lean=False, messages=messages), _publish(lean=True, messages=messages)
    # Then every message has the same body, properties (as encoded on the wire) and publish arguments
    assert len(kombu_sent) == len(lean_sent) == len(messages)
    lean_types = []
    for (k_msg, k_kw), (l_msg, l_kw) in zip(kombu_sent, lean_sent, strict=True):
        lean_types.append(type(l_msg))
        assert l_msg.body == k_msg.body and isinstance(l_msg.body, bytes)
        assert l_kw == k_kw
        assert l_msg._serialize_properties() == amqp.Message._serialize_properties(k_msg)
    # And all but the task with a priority went the lean way
    assert lean_types.count(LeanMessage) == len(messages) - 1


@pytest.mark.parametrize("props", [
    {"content_type": "application/json", "application_headers": {"a": [1, "x", None, True, 2.5, {"n": -2**40}]}},
    {"correlation_id": "", "message_id": b"raw", "priority": 0, "timestamp": 12, "application_headers": {}},
    {"application_headers": {"t": ("a", b"b")}, "delivery_mode": 1, "type": "t", "cluster_id": "c"},
])
def test_encode_properties_matches_py_amqp(props: dict[str, Any]) -> None:
    assert encode_properties(props) == amqp.Message(**props)._serialize_properties()


@pytest.mark.parametrize("value", [Decimal("1.5"), datetime.datetime(2026, 1, 1)])
def test_what_the_lean_encoder_does_not_know_goes_to_py_amqp(value: Any) -> None:
    props: dict[str, Any] = {"application_headers": {"v": value, "s": "x"}}
    assert LeanMessage(**props)._serialize_properties() == amqp.Message(**props)._serialize_properties()


def test_a_key_py_amqp_refuses_is_refused_the_same_way() -> None:
    with pytest.raises(Exception) as lean_error:
        LeanMessage(application_headers={"k" * 300: 1})._serialize_properties()
    with pytest.raises(Exception) as amqp_error:
        amqp.Message(application_headers={"k" * 300: 1})._serialize_properties()
    assert type(lean_error.value) is type(amqp_error.value)


def test_queue_spec_is_untouched_by_the_lean_path() -> None:
    # a task's queue declaration is kombu's either way (``_declare_task_queue``): the lean path only publishes
    task = _messages()[3]
    assert isinstance(task.queue, QueueSpec) and task.queue.name == "email"
