"""Idempotent tasks (``@outbox.task``) without a worker, on SQLite and on Postgres.

The task runs the way a worker runs it: ``task.apply`` (Celery's own execution path, retries included,
as tests/unit/test_consumer_tasks.py drives consumer tasks), or ``push_request`` + ``run`` where a
broker flag (``redelivered``) must be set. A crash is a ``BaseException`` raised at a crash point
(nothing may swallow it), standing in for SIGKILL; tests/tasks/test_idempotent_worker.py kills real
workers.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import states
from hypothesis import given
from hypothesis import strategies as st
from kombu import Connection
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import counters
from celery_outbox.celery.consumer_tasks import DeadLettered
from celery_outbox.celery.sender import replay_sender
from celery_outbox.clock import ManualClock
from celery_outbox.counters import DUPLICATES
from celery_outbox.errors import ConfigError, ValidationError
from celery_outbox.inbox.task_keys import KEY_MAX_CHARS, is_task_key, message_id_for, task_key
from celery_outbox.messages import is_storable
from celery_outbox.names import check_name
from celery_outbox.ops import dead_letters as dl
from celery_outbox.outbox import Outbox
from celery_outbox.schema import Tables
from celeryconfig import Settings
from tests.tasks import idempotent_app as ia


class SimulatedCrash(BaseException):
    """Stands in for SIGKILL at a crash point (BaseException: no handler may swallow it)."""


class CrashAt:
    def __init__(self, name: str) -> None:
        self.name = name

    def reached(self, name: str) -> None:
        if name == self.name:
            raise SimulatedCrash(name)


@pytest.fixture
def tasks(any_sessions: sessionmaker[Session], settings: Settings, clock: ManualClock,
          tables: Tables) -> Iterator[ia.TaskApp]:
    """The test task app on the memory broker, on SQLite or Postgres (effects table created)."""
    ia.metadata.create_all(any_sessions.kw["bind"])
    built = ia.build(settings, broker_url="memory://", session_factory=any_sessions, clock=clock)
    built.outbox._tables = tables  # one mapping of the default prefix for the whole test session
    try:
        yield built
    finally:
        _drain_memory_queue(built)
        ia.metadata.drop_all(any_sessions.kw["bind"])  # the session's shared Postgres database keeps only its own tables


def _drain_memory_queue(built: ia.TaskApp) -> list[Any]:
    """Every message on the tasks queue of the in-process memory broker (removed from it)."""
    got = []
    with Connection("memory://") as conn:
        channel = conn.default_channel
        queue = ia.tasks_queue(built.settings)
        while True:
            message = channel.basic_get(queue)
            if message is None:
                break
            got.append(message)
    return got


def run(task: Any, *args: Any, task_id: str, **kwargs: Any) -> Any:
    """The task's result as a worker would end it; a dead letter (rejected, never requeued) as "dead_lettered"."""
    result = task.apply(args=list(args), kwargs=kwargs, task_id=task_id)
    if result.state == states.REJECTED:
        assert isinstance(result.result, DeadLettered) and result.result.requeue is False, result.result
        return "dead_lettered"
    return result.get(disable_sync_subtasks=False)


def run_delivery(task: Any, *args: Any, task_id: str, redelivered: bool, retries: int = 0) -> Any:
    """One delivery as the worker makes it, with the broker's ``redelivered`` flag (``apply`` cannot set it)."""
    task.push_request(id=task_id, args=list(args), kwargs={}, retries=retries, is_eager=True,
                      delivery_info={"redelivered": redelivered})
    try:
        return task.run(*args)
    finally:
        task.pop_request()


def count(sessions: sessionmaker[Session], model: Any) -> int:
    with sessions() as s:
        return int(s.execute(sa.select(sa.func.count()).select_from(model)).scalar_one())


def effects(sessions: sessionmaker[Session], task: str, key: str | None = None) -> int:
    with sessions() as s:
        return ia.effect_count(s, task, key)


def duplicates(sessions: sessionmaker[Session], tables: Tables, consumer: str) -> int:
    with sessions() as s:
        return counters.value(s, consumer, DUPLICATES, tables=tables)


# -- the key ------------------------------------------------------------------------------------


def test_task_key_is_the_name_when_it_fits_else_a_stable_hashed_prefix() -> None:
    assert task_key("orders.send_confirmation") == "task:orders.send_confirmation"
    long = "orders.notifications.tasks.send_the_order_confirmation_email_to_the_customer"
    key = task_key(long)
    assert len(key) == KEY_MAX_CHARS and key.startswith("task#" + long[:42] + "~")
    assert key == task_key(long)  # stable: the inbox rows of yesterday still guard today's deliveries
    assert task_key(long + "2") != key


@given(st.text(min_size=1, max_size=300))
def test_task_key_fits_every_column_and_never_equals_a_consumer_name(name: str) -> None:
    key = task_key(name)
    assert len(key) <= KEY_MAX_CHARS and is_storable(key) and is_task_key(key)
    try:
        check_name(key)
    except ConfigError:
        pass  # the key of a task can never be taken for a consumer's name
    else:
        pytest.fail(f"{key!r} is a valid consumer name")


@given(st.text(min_size=1, max_size=100), st.text(min_size=1, max_size=100))
def test_different_task_names_have_different_keys(a: str, b: str) -> None:
    if a != b:
        assert task_key(a) != task_key(b)


def test_message_id_is_the_task_id_or_derived_from_it() -> None:
    tid = str(uuid.uuid4())
    assert str(message_id_for(tid)) == tid
    assert message_id_for("invoice-42") == message_id_for("invoice-42") != message_id_for("invoice-43")


# -- the task -----------------------------------------------------------------------------------


def test_defines_a_celery_task_with_late_acks_and_the_consumer_limits(tasks: ia.TaskApp) -> None:
    task = tasks.app.tasks[ia.RECORD]
    settings = tasks.settings
    assert task.acks_late and task.reject_on_worker_lost and task.acks_on_timeout is False
    assert task.max_retries is None  # the count in the database decides, never Celery's request.retries
    assert task.time_limit == settings.consumer_time_limit_s and task.soft_time_limit < task.time_limit
    assert task.outbox_task_key == "task:idem.record"
    # Celery checks .delay() arguments against the function's signature, without the session
    with pytest.raises(TypeError, match="key"):
        tasks.record.delay()
    # outbox.task("<consumer>") still looks up a consumer's task; options there are a mistake
    with pytest.raises(ConfigError, match="looks up a consumer"):
        tasks.outbox.task("billing", max_retries=1)  # type: ignore[call-overload]


def test_bad_declarations_are_refused(tasks: ia.TaskApp) -> None:
    box = tasks.outbox
    with pytest.raises(ConfigError, match="session as its first positional"):
        box.task(name="bad.no_session")(lambda *, key: None)
    with pytest.raises(ConfigError, match="acks_late"):
        box.task(name="bad.acks", acks_late=False)(lambda session: None)
    with pytest.raises(ConfigError, match="printable"):
        box.task(name="bad\x00name")(lambda session: None)
    with pytest.raises(ConfigError, match="max_retries"):
        box.task(name="bad.retries", max_retries=-1)
    with pytest.raises(ConfigError, match=r"'idem\.record' is already registered"):
        box.task(name=ia.RECORD)(lambda session, key: None)
    assert tasks.app.tasks[ia.RECORD] is tasks.record  # the first one is left as it was


def test_same_task_id_twice_one_effect_and_a_counted_duplicate(tasks: ia.TaskApp, any_sessions: sessionmaker[Session],
                                                              tables: Tables) -> None:
    # Given one task call
    tid = str(uuid.uuid4())
    # When the same task message is delivered twice (a relay duplicate, a broker redelivery)
    first = run(tasks.record, "k1", task_id=tid)
    second = run(tasks.record, "k1", task_id=tid)
    # Then the function ran once and its effect is there once
    assert (first, second) == ("k1", f"duplicate of {tid}")
    assert effects(any_sessions, ia.RECORD) == 1 and ia.calls(tasks.settings, ia.RECORD, "k1") == 1
    # And the inbox row is (task id, the task's key), typed with the task name
    with any_sessions() as s:
        [row] = s.execute(sa.select(tables.inbox)).scalars().all()
    assert (str(row.message_id), row.consumer, row.type) == (tid, "task:idem.record", ia.RECORD)
    assert duplicates(any_sessions, tables, "task:idem.record") == 1
    # And another call (another task id) has its own effect
    assert run(tasks.record, "k1", task_id=str(uuid.uuid4())) == "k1"
    assert effects(any_sessions, ia.RECORD) == 2


def test_a_task_id_that_is_not_a_uuid_is_guarded_too(tasks: ia.TaskApp, any_sessions: sessionmaker[Session]) -> None:
    assert run(tasks.record, "inv", task_id="invoice-42") == "inv"
    assert run(tasks.record, "inv", task_id="invoice-42") == f"duplicate of {message_id_for('invoice-42')}"
    assert effects(any_sessions, ia.RECORD) == 1


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth - 1):
        value = [value]
    return [value]


def test_an_argument_nested_to_the_limit_runs_one_level_deeper_is_dead_lettered(
        tasks: ia.TaskApp, any_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a task and an argument nested exactly to OUTBOX_MAX_JSON_DEPTH: delay() and the worker's gate
    # accept it (tests/unit/test_task_rules.py, "an argument nested exactly to the limit")
    limit = tasks.settings.max_json_depth

    @tasks.outbox.task(name="tests.deep", max_retries=0)
    def deep(session: Session, value: Any, *, named: Any = None) -> str:
        return "ran"

    # When it runs eagerly (no gate) and as a worker runs it (after the gate), positionally and by keyword
    assert run(deep, _nested(limit), task_id=str(uuid.uuid4())) == "ran"
    assert run(deep, 0, named=_nested(limit), task_id=str(uuid.uuid4())) == "ran"
    task_id = str(uuid.uuid4())
    deep.push_request(id=task_id, args=[_nested(limit)], kwargs={}, retries=0, is_eager=False, delivery_info={})
    try:
        assert deep.run(_nested(limit)) == "ran"
    finally:
        deep.pop_request()
    # Then it ran each time (the envelope around it adds levels that are not the caller's), and one level
    # deeper is refused as delay() refuses it: dead-lettered, never run
    assert run(deep, _nested(limit + 1), task_id=str(uuid.uuid4())) == "dead_lettered"
    assert count(any_sessions, tables.inbox) == 3
    with any_sessions() as s:
        errors = [r.last_error for r in s.scalars(sa.select(tables.dead_letters))]
    assert len(errors) == 1 and "nested deeper than" in errors[0]


def test_fails_twice_then_succeeds_one_effect(tasks: ia.TaskApp, any_sessions: sessionmaker[Session],
                                              tables: Tables) -> None:
    # Given a task whose downstream fails on its first two calls, after it wrote its effect
    # When it is delivered (Celery retries it with the task's backoff)
    assert run(tasks.flaky, "f1", task_id=str(uuid.uuid4())) == "f1"
    # Then it ran three times and its effect is there once: each failure rolled its writes back
    assert ia.calls(tasks.settings, ia.FLAKY, "f1") == 3
    assert effects(any_sessions, ia.FLAKY) == 1
    assert count(any_sessions, tables.inbox) == 1
    assert count(any_sessions, tables.attempts) == 0  # the delivery count is dropped once it succeeded
    assert count(any_sessions, tables.dead_letters) == 0


def test_always_failing_dead_lettered_after_max_retries_plus_one_then_replayed_once(
        tasks: ia.TaskApp, any_sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> None:
    settings = tasks.settings
    tid = str(uuid.uuid4())
    # Given a task (max_retries=1) that fails whatever happens
    # When it is delivered
    assert run(tasks.broken, "b1", task_id=tid) == "dead_lettered"
    # Then it ran max_retries + 1 = 2 times, left no effect, and is in the consumer dead-letter store
    assert ia.calls(settings, ia.BROKEN, "b1") == 2
    assert effects(any_sessions, ia.BROKEN) == 0
    with any_sessions() as s:
        [row] = s.execute(sa.select(tables.dead_letters)).scalars().all()
    assert (row.consumer, row.message_id, row.type, row.delivery_count) == ("task:idem.broken", tid, ia.BROKEN, 2)
    assert "ValueError: cannot handle b1 until it is fixed" in row.last_error
    assert row.headers == {"outbox_kind": "task", "task": ia.BROKEN, "task_id": tid}
    assert json.loads(row.body)["payload"] == {"args": ["b1"], "kwargs": {}}
    # And a redelivery of the dead-lettered message (a crash before its reject) neither runs it nor adds a dead letter
    with pytest.raises(DeadLettered, match="already in the dead-letter store"):
        run_delivery(tasks.broken, "b1", task_id=tid, redelivered=True)
    assert count(any_sessions, tables.dead_letters) == 1 and ia.calls(settings, ia.BROKEN, "b1") == 2

    # When the cause is fixed and the dead letter replayed the way the CLI does it
    ia.fix(settings, "b1")
    _drain_memory_queue(tasks)
    send = replay_sender(tasks.app, tasks.outbox)
    with any_sessions() as s:
        [result] = dl.replay(s, [f"consumer:{row.id}"], tables=tables, clock=clock, send=send,
                             known_consumers=tasks.outbox.known_consumers())
    assert result.replayed and "re-sent as task 'idem.broken'" in result.detail
    # Then the broker got the same task again: same name, same task id, same arguments, on its queue
    [message] = _drain_memory_queue(tasks)
    assert (message.headers["task"], message.headers["id"]) == (ia.BROKEN, tid)
    args, kwargs, _embed = message.decode()
    assert (args, kwargs) == (["b1"], {})
    # And running it has the effect once; a second copy of it is absorbed by the inbox
    assert run(tasks.broken, *args, task_id=message.headers["id"], **kwargs) == "b1"
    assert run(tasks.broken, *args, task_id=message.headers["id"], **kwargs) == f"duplicate of {tid}"
    assert effects(any_sessions, ia.BROKEN) == 1 and ia.calls(settings, ia.BROKEN, "b1") == 3
    # And replaying the same dead letter again sends nothing
    with any_sessions() as s:
        [again] = dl.replay(s, [f"consumer:{row.id}"], tables=tables, clock=clock, send=send)
    assert not again.replayed and _drain_memory_queue(tasks) == []


def test_a_task_dead_letter_this_app_cannot_run_is_refused_before_anything_changes(
        tasks: ia.TaskApp, any_sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> None:
    # Given a task dead letter, and one of a task this app does not define
    assert run(tasks.broken, "b2", task_id=str(uuid.uuid4())) == "dead_lettered"
    with any_sessions() as s:
        good = s.execute(sa.select(tables.dead_letters.id)).scalar_one()
        body = {"message_id": str(uuid.uuid4()), "type": "elsewhere.task", "payload": {"args": [], "kwargs": {}},
                "headers": {"outbox_kind": "task", "task": "elsewhere.task", "task_id": "x-1"}}
        from celery_outbox.inbox import dead_letters as store

        unknown = store.record(s, tables=tables, consumer=task_key("elsewhere.task"), message_id=str(body["message_id"]),
                               type="elsewhere.task", body=json.dumps(body), headers=body["headers"], delivery_count=2,
                               last_error="x", first_failed_at_ms=1, last_failed_at_ms=1).id
        s.commit()
    send = replay_sender(tasks.app, tasks.outbox)
    # When both are replayed in one batch
    # Then the batch is refused up front, naming the task, and nothing was sent or marked
    refused = r"consumer:\d+: no task 'elsewhere\.task'.*nothing was changed"
    with any_sessions() as s, pytest.raises(ValidationError, match=refused):
        dl.replay(s, [f"consumer:{good}", f"consumer:{unknown}"], tables=tables, clock=clock, send=send,
                  known_consumers=tasks.outbox.known_consumers())
    assert _drain_memory_queue(tasks) == []
    with any_sessions() as s:
        assert s.execute(sa.select(tables.dead_letters.replayed_at_ms)).scalars().all() == [None, None]
    # And a task dead letter whose body is not a task call cannot be sent as one
    with pytest.raises(ValidationError, match="not a stored task call"):
        send(task_key(ia.BROKEN), {"message_id": str(uuid.uuid4()), "type": ia.BROKEN, "payload": {}})


def test_crash_after_commit_before_ack_redelivered_effect_once(tasks: ia.TaskApp, any_sessions: sessionmaker[Session],
                                                               tables: Tables) -> None:
    # Given a worker that dies after the task's commit, before the ack
    tid = str(uuid.uuid4())
    tasks.outbox.crash_points = CrashAt("consumer_after_commit_before_ack")  # type: ignore[assignment]
    with pytest.raises(SimulatedCrash):
        run(tasks.record, "c1", task_id=tid)
    assert effects(any_sessions, ia.RECORD) == 1  # committed with its inbox row
    # When the broker redelivers the unacked message to a worker that lives
    tasks.outbox.crash_points = CrashAt("none")  # type: ignore[assignment]
    result = run_delivery(tasks.record, "c1", task_id=tid, redelivered=True)
    # Then the inbox answers duplicate: one effect, the function did not run again
    assert result == f"duplicate of {tid}"
    assert effects(any_sessions, ia.RECORD) == 1 and ia.calls(tasks.settings, ia.RECORD, "c1") == 1
    assert duplicates(any_sessions, tables, "task:idem.record") == 1


def test_a_plain_task_under_the_same_redelivery_runs_twice(tasks: ia.TaskApp, any_sessions: sessionmaker[Session]) -> None:
    # Given a plain @app.task (no @outbox.task) that commits its own effect
    tid = str(uuid.uuid4())
    # When the same message is delivered twice (the crash after commit, before ack, then the redelivery)
    assert run(tasks.plain, "p1", task_id=tid) == "p1"
    assert run(tasks.plain, "p1", task_id=tid) == "p1"
    # Then it ran twice and its effect is there twice: this is what @outbox.task prevents
    assert effects(any_sessions, ia.PLAIN, "p1") == 2


def test_killed_worker_deliveries_count_towards_the_dead_letter(tasks: ia.TaskApp, any_sessions: sessionmaker[Session],
                                                                tables: Tables) -> None:
    # Given a task (max_retries=2: 3 deliveries) whose worker is killed before the commit, every time
    tid = str(uuid.uuid4())
    tasks.outbox.crash_points = CrashAt("consumer_before_commit")  # type: ignore[assignment]
    with pytest.raises(SimulatedCrash):
        run_delivery(tasks.record, "w1", task_id=tid, redelivered=False)
    # When the broker redelivers it (flagged redelivered: the first, uncounted delivery is counted now)
    for _ in range(2):
        with pytest.raises(SimulatedCrash):
            run_delivery(tasks.record, "w1", task_id=tid, redelivered=True)
    assert ia.calls(tasks.settings, ia.RECORD, "w1") == 3
    # Then the next redelivery does not run it again: it is dead-lettered as lost with its worker
    with pytest.raises(DeadLettered):
        run_delivery(tasks.record, "w1", task_id=tid, redelivered=True)
    assert ia.calls(tasks.settings, ia.RECORD, "w1") == 3 and effects(any_sessions, ia.RECORD) == 0
    with any_sessions() as s:
        [row] = s.execute(sa.select(tables.dead_letters)).scalars().all()
    assert (row.consumer, row.delivery_count) == ("task:idem.record", 3) and "worker was lost" in row.last_error


def test_the_function_may_not_commit_or_roll_back_its_session(tasks: ia.TaskApp, any_sessions: sessionmaker[Session],
                                                              tables: Tables) -> None:
    box = tasks.outbox

    @box.task(name="idem.commits", max_retries=0)
    def commits(session: Session, key: str) -> None:
        session.execute(ia.effects.insert().values(task="idem.commits", key=key))
        session.commit()

    @box.task(name="idem.rolls_back", max_retries=0)
    def rolls_back(session: Session, key: str) -> None:
        session.rollback()
        session.execute(ia.effects.insert().values(task="idem.rolls_back", key=key))

    @box.task(name="idem.savepoint", max_retries=0)
    def savepoint(session: Session, key: str) -> None:
        with session.begin_nested():
            session.execute(ia.effects.insert().values(task="idem.savepoint", key=key))

    # Given functions that commit or roll back the inbox's transaction themselves
    # When they run
    # Then neither commits anything: the inbox row and the effect stay one transaction
    assert run(commits, "x", task_id=str(uuid.uuid4())) == "dead_lettered"
    assert run(rolls_back, "x", task_id=str(uuid.uuid4())) == "dead_lettered"
    assert effects(any_sessions, "idem.commits") == effects(any_sessions, "idem.rolls_back") == 0
    with any_sessions() as s:
        errors = sorted(s.execute(sa.select(tables.dead_letters.last_error)).scalars())
    assert "must not commit" in errors[0] and "must not roll back" in errors[1]
    # And a savepoint is fine
    assert run(savepoint, "x", task_id=str(uuid.uuid4())) is None
    assert effects(any_sessions, "idem.savepoint") == 1


def test_a_direct_call_has_no_task_id_and_is_refused(tasks: ia.TaskApp) -> None:
    with pytest.raises(ConfigError, match="without a task id"):
        tasks.record("k")


def test_public_outbox_task_decorator_without_arguments(outbox: Outbox) -> None:
    @outbox.task
    def bare(session: Session) -> None:
        pass

    assert bare.name.endswith("test_public_outbox_task_decorator_without_arguments.<locals>.bare")
    assert bare.outbox_task_key == task_key(bare.name)
