"""Transactional enqueue: ``task.delay()`` inside the caller's transaction is an outbox row, sent after commit.

SQLite and Postgres (``any_sessions``); the relay is ``celery_outbox.testing.drain`` with the in-memory
publisher, which records the broker messages exactly as the kombu publisher would send them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery, chain, chord, group
from freezegun import freeze_time
from kombu import Connection
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import (
    ConfigError,
    ManualClock,
    MessageTooLargeError,
    Outbox,
    SerializationError,
    Settings,
    Tables,
    TransactionRequiredError,
    ValidationError,
)
from celery_outbox.testing import InMemoryPublisher, drain


class TaskApp:
    """An app with two tasks, its outbox on the test's database, and helpers to read rows and the broker."""

    def __init__(self, sessions: sessionmaker[Session], clock: ManualClock, tables: Tables, queue: str,
                 **settings: Any) -> None:
        self.sessions = sessions
        self.queue = queue
        self.app = Celery("enq", broker=f"memory://localhost/{queue}", set_as_current=False)
        self.app.conf.update(task_routes={"enq.mail": {"queue": queue}})
        self.outbox = Outbox(self.app, session_factory=sessions, settings=Settings(**settings), clock=clock)
        self.outbox._tables = tables
        self.tables = tables

        @self.app.task(name="enq.mail", shared=False)  # type: ignore[untyped-decorator]
        def mail(to: str, subject: str = "") -> str:
            return to

        @self.app.task(name="enq.step", shared=False)  # type: ignore[untyped-decorator]
        def step(x: int) -> int:
            return x

        self.mail, self.step = mail, step

    def rows(self) -> list[Any]:
        with self.sessions() as s:
            return list(s.execute(sa.select(self.tables.outbox).order_by(self.tables.outbox.seq)).scalars())

    def broker_messages(self, queue: str | None = None) -> list[Any]:
        """Messages that went straight to the (memory) broker, bypassing the outbox."""
        out = []
        with Connection(self.app.conf.broker_url) as conn:
            q = conn.SimpleQueue(queue or self.queue, no_ack=True)
            while True:
                try:
                    out.append(q.get(timeout=0.05))
                except q.Empty:
                    break
            q.close()
        return out


@pytest.fixture
def queue() -> str:
    return f"mail-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def tasks(any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables, queue: str) -> TaskApp:
    return TaskApp(any_sessions, clock, tables, queue)


def body(message: Any) -> list[Any]:
    decoded: list[Any] = json.loads(message.body)
    return decoded


def test_rollback_leaves_no_row_and_nothing_is_published(tasks: TaskApp) -> None:
    # Given a view that enqueues a task and then fails in the same transaction
    class Declined(Exception):
        pass

    with pytest.raises(Declined), tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        tasks.mail.delay("a@example.com")
        raise Declined
    # When the relay runs, Then there was no row, nothing reached the broker, directly or through the relay
    assert tasks.rows() == []
    assert drain(tasks.outbox).published == []
    assert tasks.broker_messages() == []


def test_a_savepoint_rolled_back_takes_its_task_with_it(tasks: TaskApp) -> None:
    # Given a transaction that enqueues one task, then another with a chosen id inside a savepoint that fails
    class Declined(Exception):
        pass

    chosen = str(uuid.uuid4())
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        kept = tasks.mail.delay("kept@example.com")
        with pytest.raises(Declined), s.begin_nested():
            tasks.mail.apply_async(("gone@example.com",), task_id=chosen)
            raise Declined
        # When the chosen id is used again after the savepoint's rollback, Then it is free (no row holds it)
        again = tasks.mail.apply_async(("again@example.com",), task_id=chosen)
    # Then the commit holds the first task and the second use of the id, never the rolled-back one
    rows = {str(r.message_id): r.payload["body"][0] for r in tasks.rows()}
    assert rows == {kept.id: ["kept@example.com"], again.id: ["again@example.com"]}
    assert sorted(m.headers["id"] for m in drain(tasks.outbox).published) == sorted([kept.id, chosen])


def test_commit_then_relay_publishes_the_task_as_celery_built_it(tasks: TaskApp, clock: ManualClock) -> None:
    # Given a task enqueued at a frozen instant with countdown, expires and priority, routed by task_routes
    enqueued_at = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
    clock.set(int(enqueued_at.timestamp() * 1000))
    with freeze_time(enqueued_at), tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        result = tasks.mail.apply_async(("a@example.com",), {"subject": "hi"}, countdown=30, expires=600, priority=7)
    assert tasks.broker_messages() == []  # nothing was sent at delay() time
    [row] = tasks.rows()
    assert str(row.message_id) == result.id and row.type == "enq.mail"
    # When the relay publishes it ten minutes later
    clock.advance(10 * 60_000)
    with freeze_time(enqueued_at + timedelta(minutes=10)):
        published = drain(tasks.outbox).published
    # Then it is one protocol-2 message: real name, args, kwargs, the task id as the outbox message id,
    # the countdown computed at enqueue time (not shifted by the relay) held as the row's due time, so
    # the message carries no eta (docs/scheduled.md), expires, priority and queue kept
    [m] = published
    assert m.headers["task"] == "enq.mail" and m.headers["id"] == result.id == m.message_id
    assert body(m)[:2] == [["a@example.com"], {"subject": "hi"}]
    assert row.next_attempt_at_ms == int((enqueued_at + timedelta(seconds=30)).timestamp() * 1000)
    assert m.headers["eta"] is None
    assert datetime.fromisoformat(m.headers["expires"]) == enqueued_at + timedelta(seconds=600)
    assert m.properties["priority"] == 7 and m.properties["correlation_id"] == result.id
    assert m.exchange == "" and m.routing_key == tasks.queue
    assert m.queue is not None and m.queue.name == tasks.queue
    # And the row is marked published: a second drain sends nothing
    assert drain(tasks.outbox).published == []


def test_explicit_enqueue_and_nested_binding(tasks: TaskApp) -> None:
    # Given outbox.enqueue with a signature, and a nested transaction() block
    with tasks.sessions.begin() as s:
        r1 = tasks.outbox.enqueue(s, tasks.step.s(1))
        with tasks.outbox.transaction(s), tasks.outbox.transaction(s):
            r2 = tasks.step.delay(2)
    # Then both are rows, published with their ids
    assert [m.headers["id"] for m in drain(tasks.outbox).published] == [r1.id, r2.id]


def test_outside_a_transaction_raise_mode_raises_and_writes_nothing(any_sessions: sessionmaker[Session],
                                                                     clock: ManualClock, tables: Tables,
                                                                     queue: str) -> None:
    # Given the strict mode, When a task is sent with no transaction bound
    t = TaskApp(any_sessions, clock, tables, queue, enqueue_outside_transaction="raise")
    with pytest.raises(TransactionRequiredError, match="outside a transaction"):
        t.mail.delay("a@example.com")
    # Then nothing was written and nothing was sent
    assert t.rows() == [] and t.broker_messages() == []


def test_outside_a_transaction_publish_mode_sends_directly(any_sessions: sessionmaker[Session], clock: ManualClock,
                                                            tables: Tables, queue: str) -> None:
    t = TaskApp(any_sessions, clock, tables, queue, enqueue_outside_transaction="publish")
    result = t.mail.delay("a@example.com")
    assert t.rows() == []
    [m] = t.broker_messages()
    assert m.headers["id"] == result.id and m.headers["task"] == "enq.mail"


def test_excluded_names_and_own_tasks_bypass_the_outbox(any_sessions: sessionmaker[Session], clock: ManualClock,
                                                         tables: Tables, queue: str) -> None:
    t = TaskApp(any_sessions, clock, tables, queue, enqueue_exclude=("enq.mail",))
    with t.sessions.begin() as s, t.outbox.transaction(s):
        t.mail.delay("a@example.com")  # excluded
        t.app.send_task("celery_outbox.drain")  # the library's own task
        t.app.send_task("celery.backend_cleanup", queue=queue)  # a Celery built-in
    assert t.rows() == []
    assert [m.headers["task"] for m in t.broker_messages()] == ["enq.mail", "celery.backend_cleanup"]


def test_a_retry_sent_by_a_running_worker_task_is_never_captured(tasks: TaskApp, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a worker task (id T) running inside a bound transaction
    class Request:
        id = str(uuid.uuid4())
        root_id = id
        delivery_info: dict[str, Any] = {}

    class Running:
        request = Request()

        def add_trail(self, result: Any) -> None:
            pass

    monkeypatch.setattr(Celery, "current_worker_task", property(lambda self: Running()))
    tasks.broker_messages(queue="celery")  # kombu's memory transport is process-wide: forget other tests' leftovers
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        # When it retries itself (same task id) and enqueues another task
        tasks.mail.apply_async(("a@example.com",), task_id=Request.id, retries=1)
        other = tasks.mail.delay("b@example.com")
    # Then the retry went to the broker, the other task into the outbox
    assert [m.headers["id"] for m in tasks.broker_messages()] == [Request.id]
    assert [str(r.message_id) for r in tasks.rows()] == [other.id]
    # And outside any transaction, a running worker task sends directly whatever the mode
    follow_up = tasks.step.delay(3)
    assert [m.headers["id"] for m in tasks.broker_messages(queue="celery")] == [follow_up.id]


class Unserialisable:
    pass


@pytest.mark.parametrize("args", [(Unserialisable(),), (datetime(2030, 1, 1),), ({1, 2},), (float("nan"),)],
                         ids=["object", "datetime", "set", "nan"])
def test_non_json_arguments_fail_at_delay_inside_the_transaction(tasks: TaskApp, args: tuple[Any, ...]) -> None:
    # Given a transaction that also writes other work
    # When a task gets an argument JSON cannot carry, Then delay() raises a clear error there
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s), \
            pytest.raises(SerializationError, match=r"'enq.step' arguments .*JSON only"):
        tasks.step.delay(*args)
    # And nothing was written, nothing sent
    assert tasks.rows() == [] and drain(tasks.outbox).published == [] and tasks.broker_messages("celery") == []


def test_oversized_arguments_are_refused_inside_the_transaction(any_sessions: sessionmaker[Session],
                                                                 clock: ManualClock, tables: Tables, queue: str) -> None:
    t = TaskApp(any_sessions, clock, tables, queue, max_message_bytes=4096)
    with t.sessions.begin() as s, t.outbox.transaction(s):
        with pytest.raises(MessageTooLargeError, match=r"'enq.mail' message is .* over the limit of 4096"):
            t.mail.delay("x" * 5000)
        t.mail.delay("small")  # the transaction goes on
    assert [r.payload["body"][0] for r in t.rows()] == [["small"]]


def test_unknown_task_names_and_non_uuid_ids_are_refused(tasks: TaskApp) -> None:
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        with pytest.raises(ValidationError, match=r"'enq.typo' is neither registered .* nor routed"):
            tasks.app.send_task("enq.typo", args=[1])
        with pytest.raises(ValidationError, match="task id must be a UUID"):
            tasks.step.apply_async((1,), task_id="not-a-uuid")
    assert tasks.rows() == []


def test_a_chain_is_carried_faithfully(tasks: TaskApp) -> None:
    # Given a chain enqueued in a transaction
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        result = chain(tasks.step.s(1), tasks.step.s(), tasks.mail.si("a@example.com")).delay()
    # Then its first task is the one row, the rest of the chain in its embed exactly as Celery put it
    [m] = drain(tasks.outbox).published
    args, _kwargs, embed = body(m)
    assert m.headers["task"] == "enq.step" and args == [1]
    assert [sig["task"] for sig in reversed(embed["chain"])] == ["enq.step", "enq.mail"]
    assert result.parent is not None and m.headers["id"] == result.parent.parent.id


def test_a_group_is_one_row_per_task_with_its_group_id(tasks: TaskApp) -> None:
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        result = group(tasks.step.s(1), tasks.step.s(2)).delay()
    published = drain(tasks.outbox).published
    assert [body(m)[0] for m in published] == [[1], [2]]
    assert {m.headers["group"] for m in published} == {result.id}


def test_a_chord_is_refused_naming_what_is_unsupported(any_sessions: sessionmaker[Session], clock: ManualClock,
                                                      tables: Tables, queue: str) -> None:
    t = TaskApp(any_sessions, clock, tables, queue)
    t.app.conf.result_backend = "cache+memory://"
    with t.sessions.begin() as s, t.outbox.transaction(s), \
            pytest.raises(ValidationError, match="part of a chord, which cannot go through the outbox"):
        chord([t.step.s(1), t.step.s(2)])(t.mail.s())
    assert t.rows() == []


def test_one_outbox_per_celery_app(tasks: TaskApp) -> None:
    with pytest.raises(ConfigError, match="one Outbox per Celery app"):
        Outbox(tasks.app, session_factory=tasks.sessions, settings=Settings())


def test_settings_of_enqueue_are_validated_and_read_from_the_environment() -> None:
    s = Settings.from_env({"OUTBOX_ENQUEUE_OUTSIDE_TRANSACTION": "publish", "OUTBOX_ENQUEUE_EXCLUDE": " a.x, b.y ,"})
    assert s.enqueue_outside_transaction == "publish" and s.enqueue_exclude == ("a.x", "b.y")
    assert Settings.from_env(s.to_env()) == s and Settings().enqueue_outside_transaction == "own_transaction"
    for bad in ({"enqueue_outside_transaction": "sometimes"}, {"enqueue_exclude": "a.x"},
                {"enqueue_exclude": ("a,b",)}, {"enqueue_exclude": (" a",)}, {"enqueue_exclude": ("a\x00",)}):
        with pytest.raises(ConfigError, match="OUTBOX_ENQUEUE_"):
            Settings(**bad)


def test_the_in_memory_publisher_can_reject_a_task_like_an_event(tasks: TaskApp) -> None:
    # Given a task row the broker rejects once
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        result = tasks.step.delay(1)
    publisher = InMemoryPublisher()
    publisher.reject(result.id, times=1)
    drain(tasks.outbox, publisher)
    # Then it was charged an attempt, like an event row, and goes out after its backoff
    [row] = tasks.rows()
    assert row.attempts == 1 and row.published_at_ms is None and publisher.published == []
    tasks.outbox.clock.advance(60_000)  # type: ignore[attr-defined]
    assert [m.message_id for m in drain(tasks.outbox, publisher).published] == [result.id]


@pytest.fixture(autouse=True)
def _no_leftover_binding(request: pytest.FixtureRequest) -> Iterator[None]:
    built = request.getfixturevalue("tasks") if "tasks" in request.fixturenames else None
    yield
    if built is not None:
        assert built.outbox._enqueue_interceptor.bound.get() == ()


def test_a_scoped_session_binds_its_current_session(tasks: TaskApp) -> None:
    # Given Flask-SQLAlchemy's kind of session: a scoped_session registry
    from sqlalchemy.orm import scoped_session

    db_session = scoped_session(tasks.sessions)
    try:
        # When a task is sent inside outbox.transaction(db_session) and the scoped session commits
        with tasks.outbox.transaction(db_session):
            result = tasks.step.delay(5)
        db_session.commit()
    finally:
        db_session.remove()
    # Then the row committed with that session
    assert [str(r.message_id) for r in tasks.rows()] == [result.id]
