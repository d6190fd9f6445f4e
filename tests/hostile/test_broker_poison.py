"""Hostile broker input against real ``celery worker`` processes on Redis AND RabbitMQ (Postgres).

Raw poison is published with kombu straight onto a consumer queue (no relay, no Celery client), a
good message behind it. For every kind of poison: the worker is still alive, the good message took
effect, and the poison is in the dead-letter store after at most the configured deliveries, with
its raw body kept. Before the consumer tasks had their own strategy, a body that was valid JSON but
not the protocol-2 ``[args, kwargs, embed]`` shape stopped the worker with "Unrecoverable error".
The same worker also takes the deployment's e-mail task queue (``<ns>.email``, an ``@outbox.task``):
a JSON object there killed every worker until the worker-wide gate (celery_outbox/celery/gate.py);
every task shape is in tests/hostile/test_task_poison.py.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kombu import Connection, Producer, Queue
from sqlalchemy.orm import Session

from celery_outbox import Tables
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.inbox.dead_letters import body_bytes
from celery_outbox.messages import celery_task_message
from celeryconfig import Settings
from consumers.models import Shipment
from consumers.testing import order_placed_envelope
from tests.integration.test_consumer_worker import CONSUMERS, Worker, _queues, cleanup, declare, wait_for
from tests.support.workers import start_worker, stop_worker

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.rabbitmq, pytest.mark.workers, pytest.mark.slow]

MAX_DELIVERIES = 3
TASK = "consumers.shipping"
EMAIL_TASK = "orders.send_confirmation_email"


@dataclass
class Poison:
    name: str
    body: bytes
    content_type: str = "application/json"
    content_encoding: str = "utf-8"
    headers: dict[str, Any] = field(default_factory=dict)
    # The dead letter's message_id: the task id for poison the strategy catches, the envelope's
    # message_id for a well-formed task message whose envelope is bad.
    key: str = field(default_factory=lambda: str(uuid.uuid4()))
    raw_kept: bytes | None = None  # what the dead letter's body must give back (default: ``body``)

    def all_headers(self) -> dict[str, Any]:
        return {"lang": "py", "task": TASK, "id": self.key, "root_id": self.key, "retries": 0, **self.headers}


def triple(envelope: Any, kwargs: Any = None, embed: Any = None) -> bytes:
    return json.dumps([[envelope], kwargs or {}, embed or {}]).encode()


def bad_envelope(**fields: Any) -> tuple[str, bytes, bytes]:
    """A well-formed task message whose envelope is bad: (message_id, body, envelope text kept)."""
    mid = str(uuid.uuid4())
    env = {"message_id": mid, "type": "OrderPlaced", "payload": {"order_id": "x"}, "headers": {}, **fields}
    text = json.dumps(env, separators=(",", ":"), sort_keys=True)
    return mid, json.dumps([[env], {}, {}]).encode(), text.encode()


def poisons(broker: str) -> list[Poison]:
    deep = ("[" * 5000 + "]" * 5000).encode()
    out = [
        Poison("valid JSON, an object not a triple", b'{"args": 1}'),
        Poison("valid JSON, a number", b"42"),
        Poison("valid JSON, a pair", b"[1, 2]"),
        Poison("args not a list", b"[5, {}, {}]"),
        Poison("two args", b'[[{"a": 1}, 2], {}, {}]'),
        Poison("kwargs given", triple({"a": 1}, kwargs={"body": 1})),
        Poison("callbacks embedded", triple({"a": 1}, embed={"callbacks": [{"task": "celery.ping"}]})),
        Poison("nested past the recursion limit", b"[[" + deep + b"], {}, {}]"),
        Poison("not UTF-8", b'[["\xff\xfe\x00 not utf-8"], {}, {}]'),
        Poison("NUL in the body", b'[["\x00"], {}, {}]\x00'),
        Poison("pickle content type", b"\x80\x04K\x01.", content_type="application/x-python-serialize",
               content_encoding="binary"),
        Poison("latin-1 encoding", b'[[{"a": "\xe9"}], {}, {}]', content_encoding="latin-1"),
        Poison("huge", b'[["' + b"x" * (1024 * 1024) + b'"], {}, {}]'),
        Poison("hostile headers", b"[1]", headers={"eta": "not a date", "expires": "1970-01-01T00:00:00",
                                                   "timelimit": [0.001, 0.001], "retries": -5,
                                                   "argsrepr": "\x00nul", "shadow": "x" * 10_000}),
        Poison("task id not a UUID", b"{}", headers={"id": "\x00 not a uuid"}, key=""),
    ]
    mid, body, text = bad_envelope(type="Order\x00Placed")
    out.append(Poison("NUL in the event type", body, key=mid, raw_kept=text))
    mid, body, text = bad_envelope(type="\ud800")
    out.append(Poison("lone surrogate in the event type", body, key=mid, raw_kept=text))
    mid, body, text = bad_envelope(headers={"k\x00": "\ud800", "deep": [[[[[[[[[[1]]]]]]]]]]})
    out.append(Poison("NUL and surrogates in envelope headers", body, key=mid, raw_kept=text))
    mid, body, text = bad_envelope(payload=json.dumps({"d": json.loads("[" * 200 + "]" * 200)}))
    out.append(Poison("payload string nested too deep", body, key=mid, raw_kept=text))
    # kombu's JSON type hook ({"__type__": "bytes", ...}) must never turn a payload into bytes.
    mid, body, text = bad_envelope(payload={"__type__": "bytes", "__value__": "eA=="})
    out.append(Poison("kombu type hook in the payload", body, key=mid, raw_kept=text))
    if broker == "redis":  # AMQP header tables cannot carry a lone surrogate at all; Redis's JSON can
        out.append(Poison("lone surrogate in broker headers", b"[1]", headers={"origin": "\ud800", "x\ud800": 1}))
    return out


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request: pytest.FixtureRequest) -> tuple[str, str]:
    url: str = request.getfixturevalue(f"{request.param}_url")
    return request.param, url


@pytest.fixture
def worker(broker: tuple[str, str], pg_url: str, namespace: str, tmp_path: Path) -> Iterator[Worker]:
    _, broker_url = broker
    home = tmp_path / "home"
    home.mkdir()
    settings = Settings(home=home, database_url=pg_url, broker_url=broker_url, namespace=namespace,
                        consumer_max_deliveries=MAX_DELIVERIES, consumer_retry_backoff_s=1,
                        consumer_retry_backoff_max_s=2)
    declare(settings, broker_url)
    email = email_queue(settings)
    with Connection(broker_url) as conn:
        email(conn.channel()).declare()
    env = {**os.environ, "OUTBOX_DATABASE_URL": pg_url, "OUTBOX_BROKER_URL": broker_url,
           "OUTBOX_NAMESPACE": namespace, "OUTBOX_HOME": str(home),
           "OUTBOX_CONSUMER_MAX_DELIVERIES": str(MAX_DELIVERIES), "OUTBOX_CONSUMER_RETRY_BACKOFF_S": "1",
           "OUTBOX_CONSUMER_RETRY_BACKOFF_MAX_S": "2"}
    env.pop("OUTBOX_CRASH_POINTS", None)
    log = tmp_path / "worker.log"
    proc = start_worker(env=env, queues=[*(settings.queue_name(c) for c in CONSUMERS), email.name],
                        node=f"poison-{namespace}@%h", log=log)
    w = Worker(settings=settings, broker_url=broker_url, log=log, proc=proc)
    try:
        yield w
    finally:
        stop_worker(proc)
        with Connection(broker_url) as conn:
            email(conn.channel()).delete()
        cleanup(settings, broker_url)


def email_queue(settings: Settings) -> Queue:
    exchange, _ = _queues(settings)
    name = settings.queue_name("email")
    return Queue(name, exchange, routing_key=name, durable=True)


def email_poisons() -> list[Poison]:
    """What killed every worker on the e-mail task's queue, or vanished from it with a log line."""
    deep = b"[" * 5000 + b"]" * 5000
    return [Poison("a JSON object on the e-mail queue", b'{"a": 1}'),
            Poison("5,000 deep on the e-mail queue", b"[[" + deep + b"], {}, null]"),
            Poison("unknown task on the e-mail queue", b'[["o-1"], {}, null]', headers={"task": "orders.gone"})]


def test_poison_on_a_consumer_queue_is_dead_lettered_and_the_queue_flows(
        worker: Worker, broker: tuple[str, str], tables: Tables) -> None:
    settings, url = worker.settings, worker.broker_url
    sessions = make_session_factory(make_engine(settings.effective_database_url))
    cases = poisons(broker[0])
    exchange, _ = _queues(settings)
    queue = settings.queue_name("shipping")
    goods = [order_placed_envelope(f"good-{i}") for i in range(len(cases))]
    email_cases = email_poisons()
    # Given every kind of poison at the head of the shipping queue, each followed by a good order
    with Connection(url) as conn:
        producer = Producer(conn.channel(), exchange=exchange)
        for case, good in zip(cases, goods, strict=True):
            # When the poison is published raw, exactly as a hostile or broken publisher would
            producer.publish(case.body, routing_key=queue, headers=case.all_headers(),
                             content_type=case.content_type, content_encoding=case.content_encoding,
                             delivery_mode=2)
            msg = celery_task_message(good, consumer="shipping", routing_key=queue)
            producer.publish(msg.body, routing_key=queue, headers=msg.headers, content_type="application/json",
                             content_encoding="utf-8", delivery_mode=2, **msg.properties)
        # And the e-mail task's killers on its own queue
        for case in email_cases:
            producer.publish(case.body, routing_key=settings.queue_name("email"),
                             headers={**case.all_headers(), "task": case.headers.get("task", EMAIL_TASK)},
                             content_type=case.content_type, content_encoding=case.content_encoding, delivery_mode=2)
    letters = tables.dead_letters
    total = len(cases) + len(email_cases)

    def done(s: Session) -> tuple[bool, object]:
        shipped = set(s.execute(sa.select(Shipment.order_id)).scalars())
        count = s.execute(sa.select(sa.func.count()).select_from(letters)).scalar_one()
        return len(shipped) == len(goods) and count == total, (sorted(shipped), count)

    wait_for("every good order shipped and every poison dead-lettered", done, worker, sessions, timeout_s=180)
    # Then the worker is still alive
    assert worker.proc.poll() is None, worker.logs()
    assert "Unrecoverable error" not in worker.logs()
    with sessions() as s:
        # And every good order took effect exactly once
        assert sorted(s.execute(sa.select(Shipment.order_id)).scalars()) == sorted(g.payload["order_id"] for g in goods)
        # And every poison is in the dead-letter store once, within the configured deliveries, raw body kept
        rows = {dl.message_id: dl for dl in s.execute(sa.select(letters)).scalars()}
        assert len(rows) == total
        for case in email_cases:  # the e-mail task's: dead-lettered at once under its task key, raw bytes kept
            dl = rows.pop(case.key)
            assert dl.consumer == f"task:{case.headers.get('task', EMAIL_TASK)}", case.name
            assert (body_bytes(dl.body), dl.delivery_count) == (case.body, 1), case.name
        for case in cases:
            if not case.key:  # its task id is derived from the body: find it by its body
                [dl] = [r for r in rows.values() if body_bytes(r.body) == case.body]
            else:
                assert case.key in rows, f"{case.name}: no dead letter; have {sorted(rows)}"
                dl = rows[case.key]
            assert dl.consumer == "shipping", case.name
            assert 1 <= dl.delivery_count <= MAX_DELIVERIES, case.name
            kept = case.raw_kept if case.raw_kept is not None else case.body
            if case.name == "huge":
                assert body_bytes(dl.body) == kept[: settings.max_message_bytes], case.name
                assert "over the limit" in dl.last_error
            else:
                assert body_bytes(dl.body) == kept, case.name
        assert "\x00" not in "".join(r.last_error + (r.type or "") for r in rows.values())
    sessions.kw["bind"].dispose()
