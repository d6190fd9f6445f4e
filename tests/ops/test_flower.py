"""Outbox work as a real Flower shows it, read through Flower's HTTP API.

A real ``celery -A relay.app worker`` (consumers + the relay's drain task) and a real
``celery -A relay.app flower`` run against real Postgres and a real broker (Redis and RabbitMQ).
A message is processed, published again (a duplicate) and a poison message is dead-lettered; the
beat drain task dead-letters an oversized outbox row. Flower must show: the duplicate as an entry of
its own marked ``duplicate of <message_id>`` (the first entry untouched), the dead letter as
FAILURE with its reason, the drain with its counts, every entry and every custom event attributed to
the worker's own node name. And the rejected poison is gone from the broker for good.

The fast tests at the end check the same contract without processes: a task id per publish, the
standalone relay's dead-lettered event.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner
from kombu import Connection, Exchange, Producer, Queue
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.celery import events
from celery_outbox.celery.config import DRAIN_TASK
from celery_outbox.clock import ManualClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.messages import Envelope, TaskMessage, celery_task_message, celery_task_messages
from celeryconfig import Settings, celery_config
from consumers.testing import order_placed_envelope
from tests.integration.test_consumer_worker import CELERY, ROOT, cleanup, declare
from tests.outbox_rows import insert_pending
from tests.support.workers import TASK_EVENTS_BY_REMOTE, stop_process

MAX_MESSAGE_BYTES = 4096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Proc:
    proc: subprocess.Popen[bytes]
    log: Path

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-6000:] if self.log.exists() else ""

    def stop(self) -> None:
        stop_process(self.proc, timeout_s=30)  # warm shutdown: unacked messages go back to the broker


def start(argv: list[str], env: dict[str, str], log: Path) -> Proc:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Proc(proc, log)


@dataclass
class Stack:
    settings: Settings
    broker_url: str
    node: str
    worker: Proc
    flower: Proc
    base: str

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=10) as r:
            return json.loads(r.read())

    def wait(self, what: str, probe: Callable[[], tuple[bool, object]], timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        last: object = None
        while time.monotonic() < deadline:
            for p in (self.worker, self.flower):
                if p.proc.poll() is not None:
                    pytest.fail(f"{p.log.name} exited with {p.proc.returncode} while waiting for {what}\n{p.logs()}")
            try:
                ok, last = probe()
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                ok, last = False, e
            if ok:
                return
            time.sleep(0.3)
        pytest.fail(f"timed out waiting for {what}; last {last!r}\n--- worker ---\n{self.worker.logs()}"
                    f"\n--- flower ---\n{self.flower.logs()}")

    def wait_task_events_on(self) -> None:
        """Until Flower has turned the worker's task events on (its periodic ``enable_events`` broadcast,
        every 5 s): the worker logs it only when its own configuration left them off (docs/operations.md)."""
        self.wait("Flower to turn the worker's task events on",
                  lambda: (TASK_EVENTS_BY_REMOTE in self.worker.logs(), "not in the worker's log yet"))

    def tasks(self) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = self.get("/api/tasks")
        return found

    def worker_counters(self) -> dict[str, Any]:
        """Flower's per-worker event counters (its workers page), for our node only."""
        data = self.get("/workers?json=1")["data"]
        return next((w for w in data if w.get("hostname") == self.node), {})


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
def stack(request: pytest.FixtureRequest, pg_url: str, namespace: str, tmp_path: Path) -> Iterator[Stack]:
    broker_url: str = request.getfixturevalue(f"{request.param}_url")
    home = tmp_path / "home"
    home.mkdir()
    settings = Settings(home=home, database_url=pg_url, broker_url=broker_url, namespace=namespace,
                        consumer_max_deliveries=3, consumer_retry_backoff_s=1, consumer_retry_backoff_max_s=2,
                        max_message_bytes=MAX_MESSAGE_BYTES)
    declare(settings, broker_url)
    env = {**os.environ, "OUTBOX_DATABASE_URL": pg_url, "OUTBOX_BROKER_URL": broker_url,
           "OUTBOX_NAMESPACE": namespace, "OUTBOX_HOME": str(home), "OUTBOX_CONSUMER_MAX_DELIVERIES": "3",
           "OUTBOX_CONSUMER_RETRY_BACKOFF_S": "1", "OUTBOX_CONSUMER_RETRY_BACKOFF_MAX_S": "2",
           "OUTBOX_MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES)}
    env.pop("OUTBOX_CRASH_POINTS", None)
    node = f"flower-{namespace}@{socket.gethostname()}"
    # Heartbeats on: Flower learns the worker from them. No -E, and no task events in the configuration:
    # Flower turns them on (docs/operations.md, "Flower")
    assert not {"worker_send_task_events", "task_send_sent_event"} & set(celery_config(settings, broker_url))
    worker = start([CELERY, "-A", "relay.app", "worker", "-Q", f"{settings.queue_name('shipping')},{namespace}.relay",
                    "-P", "prefork", "-c", "2", "--without-gossip", "--without-mingle", "-l", "INFO",
                    "-n", f"flower-{namespace}@%h"], env, tmp_path / "worker.log")
    port = free_port()
    flower = start([CELERY, "-A", "relay.app", "flower", f"--port={port}", "--address=127.0.0.1"],
                   {**env, "FLOWER_UNAUTHENTICATED_API": "true"}, tmp_path / "flower.log")
    s = Stack(settings=settings, broker_url=broker_url, node=node, worker=worker, flower=flower,
              base=f"http://127.0.0.1:{port}")
    try:
        yield s
    finally:
        flower.stop()
        worker.stop()
        cleanup(settings, broker_url)
        with Connection(broker_url) as conn:
            channel = conn.channel()
            Queue(f"{namespace}.relay", no_declare=True)(channel).delete()
            Exchange(f"{namespace}.relay")(channel).delete()


def shipping_depth(settings: Settings, url: str) -> int:
    """Messages left on the shipping queue, counting any a broker still holds unacked (Redis)."""
    name = settings.queue_name("shipping")
    with Connection(url) as conn:
        if not url.startswith("redis"):
            _, ready, _ = Queue(name, no_declare=True)(conn.channel()).queue_declare(passive=True)
            return int(ready)
        client = conn.channel().client  # Redis: the queue is a list; taken messages wait in an "unacked" hash
        unacked = sum(name.encode() in v for key in client.scan_iter(match="*unacked") for v in client.hvals(key))
        return int(client.llen(name)) + unacked


@pytest.mark.postgres
@pytest.mark.workers
@pytest.mark.slow
def test_flower_shows_processed_duplicate_dead_letter_and_drain(stack: Stack, tables: Tables) -> None:
    settings, url = stack.settings, stack.broker_url
    # Given Flower receiving the worker's events (it has seen the worker's heartbeat and turned its task events on)
    stack.wait("Flower to see the worker", lambda: (bool(stack.worker_counters()), stack.get("/workers?json=1")))
    stack.wait_task_events_on()

    # When an order is published to shipping and processed
    order = order_placed_envelope("o-flower")
    [first] = celery_task_messages(order, targets=[("shipping", settings.queue_name("shipping"))])
    publish_messages(settings, url, [first])

    def state(tid: str, want: str) -> Callable[[], tuple[bool, object]]:
        return lambda: ((t := stack.tasks().get(tid, {})).get("state") == want, t)

    stack.wait("the first delivery to succeed", state(first.headers["id"], "SUCCESS"))
    # And it is published again (the relay re-published it), and a poison message is published
    [again] = celery_task_messages(order, targets=[("shipping", settings.queue_name("shipping"))])
    poison = Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload="not json", headers={})
    poison_msg = celery_task_message(poison, consumer="shipping", routing_key=settings.queue_name("shipping"))
    publish_messages(settings, url, [again, poison_msg])
    # And the beat drain task runs over an outbox row too large to publish
    sessions = make_session_factory(make_engine(settings.effective_database_url))
    [too_big] = insert_pending(sessions, int(time.time() * 1000), 1, tables=tables,
                               payload=lambda i, mid: {"blob": "x" * (2 * MAX_MESSAGE_BYTES)})
    client = Celery("flower-test", set_as_current=False)
    client.conf.update(celery_config(settings, url))
    drain_id = client.send_task(DRAIN_TASK, queue=f"{settings.namespace}.relay").id

    stack.wait("the duplicate to succeed", state(again.headers["id"], "SUCCESS"))
    stack.wait("the poison to fail", state(poison_msg.headers["id"], "FAILURE"))
    stack.wait("the drain to succeed", state(drain_id, "SUCCESS"))
    tasks = stack.tasks()
    done, dup, dead, drain = (tasks[t] for t in (first.headers["id"], again.headers["id"], poison_msg.headers["id"],
                                                 drain_id))
    # Then the duplicate is an entry of its own, marked, and the first delivery's entry is untouched
    assert first.headers["id"] != again.headers["id"]
    assert done["result"] == "'processed'", done
    assert dup["result"] == f"'duplicate of {order.message_id}'", dup
    # And the dead letter is a FAILURE carrying its reason (never SUCCESS with a string)
    assert dead["exception"].startswith("DeadLettered(dead-lettered for shipping after 3 deliveries"), dead
    assert "payload is not JSON" in dead["exception"] and dead["result"] is None
    # And the drain shows its counts
    assert "'dead_lettered': 1" in drain["result"] and "'published': 0" in drain["result"], drain
    # And every entry belongs to the worker's own node name
    assert {t["worker"] for t in (done, dup, dead, drain)} == {stack.node}
    # And the custom events are counted on that worker: one duplicate, two dead letters (consumer, outbox)
    stack.wait("the custom events on the worker's counters",
               lambda: ((c := stack.worker_counters()).get(events.DUPLICATE_ABSORBED) == 1
                        and c.get(events.DEAD_LETTERED) == 2, c))
    with sessions() as s:
        assert s.execute(sa.select(tables.dead_letters.message_id)).scalars().all() == [str(poison.message_id)]
        row = s.execute(sa.select(tables.outbox).where(tables.outbox.message_id == too_big)).scalar_one()
        assert row.dead_lettered_at_ms is not None
    sessions.kw["bind"].dispose()

    # When the worker is stopped (warm: whatever it holds unacked goes back to the broker)
    stack.worker.stop()
    # Then nothing is left on the queue: the rejected poison was removed, not requeued or redelivered
    assert shipping_depth(settings, url) == 0


@pytest.mark.postgres
@pytest.mark.workers
@pytest.mark.slow
def test_flower_turns_on_the_task_events_our_configuration_leaves_off(stack: Stack) -> None:
    # Given a worker on the recommended configuration, which sets no task events, started without -E (the
    # fixture), and a Flower beside it
    config = celery_config(stack.settings, stack.broker_url)
    assert not {"worker_send_task_events", "task_send_sent_event"} & set(config)
    # When Flower's periodic enable_events broadcast reaches the worker (its log says so only when task
    # events were off: a configuration forcing them on fails here)
    stack.wait_task_events_on()
    # Then a delivery shows in Flower's API, received, started and succeeded on the worker's own node
    [msg] = celery_task_messages(order_placed_envelope("o-events-on"),
                                 targets=[("shipping", stack.settings.queue_name("shipping"))])
    publish_messages(stack.settings, stack.broker_url, [msg])
    tid = msg.headers["id"]
    stack.wait("the delivery to succeed in Flower",
               lambda: ((t := stack.tasks().get(tid, {})).get("state") == "SUCCESS", t))
    task = stack.tasks()[tid]
    assert task["received"] and task["started"] and task["succeeded"], task
    assert task["worker"] == stack.node and task["result"] == "'processed'", task


def publish_messages(settings: Settings, url: str, messages: list[TaskMessage]) -> None:
    """Publish task messages exactly as the relay does (these tests need their task ids)."""
    exchange = Exchange(settings.exchange_name, type="direct", durable=True)
    with Connection(url) as conn:
        producer = Producer(conn.channel(), exchange=exchange)
        for msg in messages:
            producer.publish(msg.body, routing_key=msg.routing_key, headers=msg.headers,
                             content_type="application/json", content_encoding="utf-8", delivery_mode=2,
                             **msg.properties)


def test_every_publish_of_a_message_is_a_task_of_its_own() -> None:
    # Given one event for two consumers, published twice (a relay that crashed before marking)
    env = order_placed_envelope("o-ids")
    targets = [("shipping", "q.shipping"), ("billing", "q.billing")]
    ids = [m.headers["id"] for _ in range(2) for m in celery_task_messages(env, targets=targets)]
    # Then every message has its own task id (Flower keeps every delivery), a UUID, its correlation id
    assert len(set(ids)) == 4 and all(str(uuid.UUID(i)) == i for i in ids)
    msg = celery_task_message(env, consumer="shipping", routing_key="q.shipping")
    assert msg.headers["root_id"] == msg.headers["id"] == msg.properties["correlation_id"]
    # And the inbox key travels in the body, the same for every copy
    assert json.loads(msg.body)[0][0]["message_id"] == str(env.message_id) == msg.headers["outbox_message_id"]


def test_standalone_relay_sends_a_dead_lettered_event_per_outbox_dead_letter(
        settings: Settings, sqlite_url: str, tmp_home: Path, sqlite_sessions: sessionmaker[Session],
        clock: ManualClock, tables: Tables, monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_outbox.cli import cli

    # Given an outbox row too large to publish and a good one, and the Celery event sender recorded
    sent: list[tuple[str, dict[str, Any]]] = []

    def record(app: Any, type: str, **fields: Any) -> bool:
        sent.append((type, fields))
        return True

    monkeypatch.setattr(events, "send_event", record)
    monkeypatch.delitem(sys.modules, "relay.app", raising=False)
    [bad] = insert_pending(sqlite_sessions, clock.now_ms(), 1, tables=tables,
                           payload=lambda i, mid: {"blob": "x" * 5_000})
    insert_pending(sqlite_sessions, clock.now_ms(), 1, tables=tables)
    env = {"OUTBOX_DATABASE_URL": sqlite_url, "OUTBOX_BROKER_URL": "memory://", "OUTBOX_NAMESPACE": settings.namespace,
           "OUTBOX_HOME": str(tmp_home), "OUTBOX_MAX_MESSAGE_BYTES": "2000"}
    # When the standalone relay drains once
    result = CliRunner().invoke(cli, ["relay", "--once"], env=env)
    # Then it dead-lettered the row and sent one event for it, under the relay's own node name
    assert result.exit_code == 0, result.output
    assert "published 1, failed 0, dead-lettered 1" in result.output
    [(etype, fields)] = sent
    assert etype == events.DEAD_LETTERED
    assert fields["source"] == "outbox" and fields["message_id"] == str(bad)
    assert "over the limit of 2000 bytes" in fields["error"]
    assert fields["hostname"] == f"outbox-relay@{socket.gethostname()}"


def test_a_failing_drain_callback_never_fails_the_relay(settings: Settings, sqlite_sessions: sessionmaker[Session],
                                                        clock: ManualClock, tables: Tables,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    from celery_outbox.relay.loop import RelayLoop
    from celery_outbox.testing import InMemoryPublisher

    # Given a relay loop whose drain callback raises
    def broken(result: Any) -> None:
        raise RuntimeError("event exchange gone")

    insert_pending(sqlite_sessions, clock.now_ms(), 2, tables=tables)
    loop = RelayLoop(settings=settings, tables=tables, session_factory=sqlite_sessions, publisher=InMemoryPublisher(),
                     clock=clock, listen=False, on_drain=broken)
    try:
        # When it drains
        result = loop.drain_once()
    finally:
        loop.close()
    # Then the drain's result stands and the callback's failure is logged
    assert result.published == 2
    assert "on_drain callback failed" in caplog.text
