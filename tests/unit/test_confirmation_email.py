"""The Orders service's confirmation e-mail task (orders/tasks.py): enqueued with the order, sent once.

The task runs as a worker runs it (``task.apply``: Celery's execution path, ``before_start`` and
retries included); a crash is a ``BaseException`` at a crash point, standing in for SIGKILL.
tests/chaos and the demo run it in real workers.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from celery import states
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Outbox
from celery_outbox.clock import ManualClock
from celery_outbox.schema import Tables
from celeryconfig import Settings
from consumers.email_provider import FakeEmailProvider
from consumers.models import SentEmail
from orders import tasks as order_tasks
from orders.service import ORDER_PLACED, parse_order, place_order
from relay.factory import create_outbox

ORDER = {"order_id": "o-1", "customer_id": "c-1", "email": "ada@example.com", "currency": "EUR",
         "lines": [{"sku": "sku-1", "quantity": 2, "unit_price_cents": 500}]}
KEY = f"task:{order_tasks.NAME}"  # the inbox key of the task (celery_outbox.inbox.task_keys)


class SimulatedCrash(BaseException):
    """Stands in for SIGKILL at a crash point (BaseException: no handler may swallow it)."""


class CrashAt:
    def __init__(self, name: str) -> None:
        self.name = name

    def reached(self, name: str) -> None:
        if name == self.name:
            raise SimulatedCrash(name)


def placed(outbox: Outbox, sessions: sessionmaker[Session], tables: Tables) -> str:
    """Place ORDER; return the task id of its confirmation e-mail row."""
    with sessions() as s:
        place_order(s, parse_order(ORDER), outbox=outbox)
    with sessions() as s:
        row = s.execute(sa.select(tables.outbox).where(tables.outbox.type == order_tasks.NAME)).scalar_one()
    return str(row.message_id)


def run(outbox: Outbox, task_id: str, *args: Any) -> Any:
    result = order_tasks.confirmation_email_task(outbox).apply(args=list(args or ["o-1"]), task_id=task_id)
    if result.state == states.REJECTED:
        return "dead_lettered"
    return result.get(disable_sync_subtasks=False)


def sent(sessions: sessionmaker[Session]) -> list[tuple[str, str, str, int]]:
    with sessions() as s:
        return [(r.idempotency_key, r.to, r.subject, r.calls) for r in s.scalars(sa.select(SentEmail))]


def inbox_rows(sessions: sessionmaker[Session], tables: Tables) -> list[tuple[str, str]]:
    with sessions() as s:
        return [(str(m), c) for m, c in s.execute(sa.select(tables.inbox.message_id, tables.inbox.consumer))]


def test_place_order_enqueues_the_task_in_its_transaction(outbox: Outbox, sqlite_sessions: sessionmaker[Session],
                                                          tables: Tables) -> None:
    # When an order is placed
    tid = placed(outbox, sqlite_sessions, tables)
    # Then its transaction holds the OrderPlaced event and the e-mail task, routed to <namespace>.email
    with sqlite_sessions() as s:
        rows = {r.type: r for r in s.scalars(sa.select(tables.outbox))}
    assert sorted(rows) == sorted([ORDER_PLACED, order_tasks.NAME])
    task = rows[order_tasks.NAME]
    assert task.headers["task_headers"]["task"] == order_tasks.NAME and task.headers["task_headers"]["id"] == tid
    assert task.headers["routing_key"] == outbox.settings.queue_name("email")
    # And the e-mail consumer is no longer routed: the task is the one way the deployment sends it
    assert outbox.routes()[ORDER_PLACED] == ("shipping", "billing", "search")
    # And the deployment's workers (demo, chaos, docker-compose) consume the task's queue
    settings = outbox.settings
    assert isinstance(settings, Settings) and settings.queue_name("email") in settings.worker_queues


def test_sends_once_per_task_id_and_records_the_inbox_row(outbox: Outbox, sqlite_sessions: sessionmaker[Session],
                                                          tables: Tables) -> None:
    tid = placed(outbox, sqlite_sessions, tables)
    # When the task runs
    key = run(outbox, tid)
    # Then the provider got the confirmation under a key derived from the task id, and the inbox has the task
    assert key == order_tasks.confirmation_key(tid) == f"{order_tasks.NAME}:{tid}"
    assert sent(sqlite_sessions) == [(key, "ada@example.com", "Order o-1 confirmed", 1)]
    assert inbox_rows(sqlite_sessions, tables) == [(tid, KEY)]
    # When the same task is delivered again (relay duplicate, broker redelivery, replay)
    assert run(outbox, tid) == f"duplicate of {tid}"
    # Then the provider was asked again with the SAME key and sent nothing new
    assert sent(sqlite_sessions) == [(key, "ada@example.com", "Order o-1 confirmed", 2)]
    # And another task id is another e-mail
    other = str(uuid.uuid4())
    assert run(outbox, other) == order_tasks.confirmation_key(other)
    assert len(sent(sqlite_sessions)) == 2


def test_a_crash_after_the_provider_call_before_the_commit_sends_once(
        outbox: Outbox, sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    tid = placed(outbox, sqlite_sessions, tables)
    # Given a worker that dies after the provider call, before the inbox commit
    outbox.crash_points = CrashAt("consumer_before_commit")  # type: ignore[assignment]
    with pytest.raises(SimulatedCrash):
        run(outbox, tid)
    assert [c for *_, c in sent(sqlite_sessions)] == [1] and inbox_rows(sqlite_sessions, tables) == []
    # When the message is redelivered to a worker that lives
    outbox.crash_points = CrashAt("none")  # type: ignore[assignment]
    assert run(outbox, tid) == order_tasks.confirmation_key(tid)
    # Then the provider was called twice with one key: ONE e-mail, and the inbox records the task once
    assert sent(sqlite_sessions) == [(order_tasks.confirmation_key(tid), "ada@example.com", "Order o-1 confirmed", 2)]
    assert inbox_rows(sqlite_sessions, tables) == [(tid, KEY)]


def test_a_provider_failure_is_retried_with_the_same_key(outbox: Outbox, sqlite_sessions: sessionmaker[Session],
                                                        tables: Tables, monkeypatch: pytest.MonkeyPatch) -> None:
    tid = placed(outbox, sqlite_sessions, tables)
    failures = {"left": 2}

    class Flaky(FakeEmailProvider):
        def send(self, *, to: str, subject: str, body: str, idempotency_key: str) -> str:
            if failures["left"]:
                failures["left"] -= 1
                raise ConnectionError("provider unavailable")
            return super().send(to=to, subject=subject, body=body, idempotency_key=idempotency_key)

    monkeypatch.setattr(order_tasks, "FakeEmailProvider", Flaky)
    # When the provider fails twice, then answers
    assert run(outbox, tid) == order_tasks.confirmation_key(tid)
    # Then the task was retried (the failure took the task's retry policy) and sent one e-mail
    assert failures["left"] == 0
    assert [c for *_, c in sent(sqlite_sessions)] == [1]
    assert inbox_rows(sqlite_sessions, tables) == [(tid, KEY)]


def test_an_unknown_order_is_dead_lettered_not_sent(outbox: Outbox, sqlite_sessions: sessionmaker[Session],
                                                    tables: Tables) -> None:
    # When the task runs for an order that does not exist
    tid = str(uuid.uuid4())
    assert run(outbox, tid, "no-such-order") == "dead_lettered"
    # Then nothing was sent, no inbox row, and the task is in the dead-letter store under its key
    assert sent(sqlite_sessions) == [] and inbox_rows(sqlite_sessions, tables) == []
    with sqlite_sessions() as s:
        [row] = s.execute(sa.select(tables.dead_letters)).scalars().all()
    assert (row.consumer, row.message_id) == (KEY, tid)
    assert "does not exist" in row.last_error


def test_an_order_is_placed_with_the_broker_down(settings: Settings, sqlite_sessions: sessionmaker[Session],
                                                 clock: ManualClock, tables: Tables) -> None:
    # Given an outbox whose broker refuses connections
    box = create_outbox(settings.replace(broker_url="redis://127.0.0.1:1/0"), session_factory=sqlite_sessions,
                        clock=clock)
    box._tables = tables
    # When an order is placed (its e-mail task enqueued with .delay())
    placed(box, sqlite_sessions, tables)
    # Then it committed with both rows: enqueueing never touches the broker, the relay publishes later
    with sqlite_sessions() as s:
        kinds = sorted(s.scalars(sa.select(tables.outbox.type)))
    assert kinds == sorted([ORDER_PLACED, order_tasks.NAME])
