"""KombuPublisher, the beat task and ``outbox relay --once`` against kombu's in-process memory transport."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from kombu import Connection
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Outbox
from celery_outbox.celery.config import DRAIN_TASK
from celery_outbox.celery.kombu_publisher import KombuPublisher
from celery_outbox.clock import ManualClock
from celery_outbox.messages import Envelope, celery_task_message
from celery_outbox.relay.dispatch import dispatch_with_settings
from celery_outbox.schema import Tables
from celeryconfig import Settings
from tests.outbox_rows import insert_pending


def insert(sessions: sessionmaker[Session], clock: ManualClock, tables: Tables, n: int) -> set[str]:
    return {str(i) for i in insert_pending(sessions, clock.now_ms(), n, tables=tables,
                                           payload=lambda i, mid: {"id": str(mid)})}

def drain_queue(url: str, name: str) -> list[tuple[dict[str, object], list[object], int | None]]:
    out = []
    with Connection(url) as conn:
        queue = conn.SimpleQueue(name)
        while queue.qsize():
            msg = queue.get(timeout=1)
            out.append((dict(msg.headers), json.loads(msg.body), msg.properties.get("delivery_mode")))
            msg.ack()
        queue.close()
    return out


def test_dispatch_through_kombu_lands_in_every_consumer_queue(settings: Settings,
                                                              sqlite_sessions: sessionmaker[Session],
                                                              clock: ManualClock, tables: Tables) -> None:
    ids = insert(sqlite_sessions, clock, tables, 3)
    with KombuPublisher(broker_url="memory://", settings=settings) as pub, sqlite_sessions() as s:
        result = dispatch_with_settings(s, pub, clock, settings, tables=tables)
    assert result.published == 3
    for consumer in settings.consumers:
        got = drain_queue("memory://", settings.queue_name(consumer))
        assert {h["outbox_message_id"] for h, _, _ in got} == ids
        assert {h["task"] for h, _, _ in got} == {f"consumers.{consumer}"}
        assert all(body[0][0]["message_id"] == h["outbox_message_id"] for h, body, _ in got)  # type: ignore[index]
        assert {mode for _, _, mode in got} == {2}  # persistent


def test_publisher_keeps_one_connection_across_batches(settings: Settings) -> None:
    env = Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload={})
    msg = celery_task_message(env, consumer="shipping", routing_key=settings.queue_name("shipping"))
    with KombuPublisher(broker_url="memory://", settings=settings) as pub:
        for _ in range(3):
            assert pub.publish_batch([msg]).confirmed == (0,)
        assert pub.connections_opened == 1
    assert len(drain_queue("memory://", settings.queue_name("shipping"))) == 3


def test_beat_task_drains_the_outbox(settings: Settings, outbox: Outbox, sqlite_sessions: sessionmaker[Session],
                                     clock: ManualClock, tables: Tables) -> None:
    ids = insert(sqlite_sessions, clock, tables, 4)
    app = outbox.app  # the deployment's app on the memory broker: the Outbox defined the relay's tasks on it
    task = app.tasks[DRAIN_TASK]
    assert DRAIN_TASK == "celery_outbox.drain"
    assert app.amqp.router.route({}, DRAIN_TASK)["queue"].name == f"{settings.namespace}.relay"
    summary = task.apply().get()
    assert summary["published"] == 4
    assert {h["outbox_message_id"] for h, _, _ in drain_queue("memory://", settings.queue_name("billing"))} == ids


def test_cli_relay_once_drains_and_exits(settings: Settings, sqlite_url: str, tmp_home: Path,
                                         sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_outbox.cli import cli

    # OUTBOX_APP (tests/conftest.py) is the reference deployment's relay.app, built from OUTBOX_* when first imported:
    # import it afresh under this test's environment.
    monkeypatch.delitem(sys.modules, "relay.app", raising=False)
    ids = insert(sqlite_sessions, clock, tables, 2)
    env = {"OUTBOX_DATABASE_URL": sqlite_url, "OUTBOX_BROKER_URL": "memory://",
           "OUTBOX_NAMESPACE": settings.namespace, "OUTBOX_HOME": str(tmp_home)}
    result = CliRunner().invoke(cli, ["relay", "--once", "--batch-size", "1"], env=env)
    assert result.exit_code == 0, result.output
    assert "published 2" in result.output
    assert {h["outbox_message_id"] for h, _, _ in drain_queue("memory://", settings.queue_name("search"))} == ids


@pytest.mark.parametrize(("args", "expect_exit", "expect_text"), [
    (["--batch-size", "2000"], 0, "published 3"),  # a first batch above the default ceiling raises the ceiling
    (["--batch-size", "2", "--max-in-flight", "2"], 0, "published 3"),
    (["--batch-size", "20", "--max-in-flight", "10"], 2, "OUTBOX_RELAY_MAX_IN_FLIGHT_ROWS"),
])
def test_cli_relay_batch_and_in_flight_options(args: list[str], expect_exit: int, expect_text: str, settings: Settings,
                                               sqlite_url: str, tmp_home: Path, sqlite_sessions: sessionmaker[Session],
                                               clock: ManualClock, tables: Tables,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_outbox.cli import cli

    monkeypatch.delitem(sys.modules, "relay.app", raising=False)
    insert(sqlite_sessions, clock, tables, 3)
    env = {"OUTBOX_DATABASE_URL": sqlite_url, "OUTBOX_BROKER_URL": "memory://",
           "OUTBOX_NAMESPACE": settings.namespace, "OUTBOX_HOME": str(tmp_home)}
    result = CliRunner().invoke(cli, ["relay", "--once", *args], env=env)
    assert result.exit_code == expect_exit, result.output
    assert expect_text in result.output
    assert "Traceback" not in result.output
