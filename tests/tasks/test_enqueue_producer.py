"""A captured ``.delay()`` takes no producer from Celery's pool (celery_outbox/celery/enqueue.py, ``SendTask`` and
``CaptureProducer``): the capture never talks to the broker. What the caller sees is Celery's: the
``AsyncResult`` with the task id (the row's message id), ``before_task_publish`` / ``after_task_publish`` once
each. A send the capture lets through takes one pooled producer, as plain Celery does; with the RPC result
backend (whose ``on_task_call`` declares its reply queue on the producer) Celery takes it as before.
SQLite and Postgres (``any_sessions``), the in-memory broker.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import signals
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import ManualClock, Tables
from celery_outbox.celery.enqueue import publishing_directly
from tests.tasks.test_enqueue import TaskApp


class Acquired:
    """Counts the producers Celery takes from the app's pool (``app._acquire_producer``)."""

    def __init__(self, app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = app._acquire_producer

        def acquire(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(app, "_acquire_producer", acquire)


@pytest.fixture
def tasks(any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> TaskApp:
    return TaskApp(any_sessions, clock, tables, f"prod-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def published() -> Iterator[list[tuple[str, str]]]:
    """(signal, task id) of every before/after_task_publish sent while the test runs."""
    seen: list[tuple[str, str]] = []

    def before(sender: Any = None, headers: Any = None, **kwargs: Any) -> None:
        seen.append(("before", headers["id"]))

    def after(sender: Any = None, headers: Any = None, **kwargs: Any) -> None:
        seen.append(("after", headers["id"]))

    signals.before_task_publish.connect(before)
    signals.after_task_publish.connect(after)
    yield seen
    signals.before_task_publish.disconnect(before)
    signals.after_task_publish.disconnect(after)


def test_a_captured_delay_takes_no_producer_and_returns_celerys_result(
        tasks: TaskApp, monkeypatch: pytest.MonkeyPatch, published: list[tuple[str, str]]) -> None:
    acquired = Acquired(tasks.app, monkeypatch)
    # When a task is sent inside a bound transaction
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        result = tasks.mail.delay("a@example.com")
    # Then no producer was taken from the pool, and nothing reached the broker
    assert acquired.count == 0 and tasks.broker_messages() == []
    # And the caller got Celery's AsyncResult of this app, whose id is the row's message id
    [row] = tasks.rows()
    assert isinstance(result, tasks.app.AsyncResult) and result.app is tasks.app
    assert result.id == str(row.message_id) and not result.ignored
    # And Celery's publish signals ran once each, for this task
    assert published == [("before", result.id), ("after", result.id)]


def test_a_send_the_capture_lets_through_takes_one_pooled_producer(
        tasks: TaskApp, monkeypatch: pytest.MonkeyPatch, published: list[tuple[str, str]]) -> None:
    acquired = Acquired(tasks.app, monkeypatch)
    # When a task is sent directly (not captured) inside a bound transaction
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s), publishing_directly(tasks.app):
        result = tasks.mail.delay("direct@example.com")
    # Then Celery took one producer from its pool and the message reached the broker, with no row
    assert acquired.count == 1
    [message] = tasks.broker_messages()
    assert message.headers["id"] == result.id and tasks.rows() == []
    assert published == [("before", result.id), ("after", result.id)]


def test_with_the_rpc_backend_celery_takes_the_producer_as_before(
        any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an app whose result backend is RPC (its on_task_call declares the reply queue on the producer)
    tasks = TaskApp(any_sessions, clock, tables, f"prod-{uuid.uuid4().hex[:8]}")
    tasks.app.conf.result_backend = "rpc://"
    acquired = Acquired(tasks.app, monkeypatch)
    # When a task whose result is kept is captured
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        result = tasks.mail.delay("rpc@example.com")
    # Then Celery took a pooled producer (the backend declared its reply queue on it), and the task is a row
    assert acquired.count == 1
    assert [str(r.message_id) for r in tasks.rows()] == [result.id]
