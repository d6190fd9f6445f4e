"""The capture's state is its Outbox's own (celery_outbox/celery/enqueue.py, ``Interceptor``): two Outboxes in one
process share no binding, no ``publishing_directly``, no dedup record; each thread and asyncio task sees its own
bound transaction; and no module under ``celery_outbox/celery/`` keeps mutable state of its own (a rule of the
design). SQLite and Postgres (``any_sessions``), the in-memory broker.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import pkgutil
import re
import threading
import types
import typing
import uuid
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

import celery_outbox.celery
from celery_outbox import ManualClock, Tables, TransactionRequiredError
from celery_outbox.celery.enqueue import publishing_directly
from tests.tasks.test_enqueue import TaskApp

# type(annotations): what `from __future__ import annotations` binds in a module; a compiled pattern and
# a JSON codec built once (the strategy's) keep nothing between calls
IMMUTABLE = (str, bytes, int, float, bool, type(None), tuple, frozenset, uuid.UUID, types.MappingProxyType,
             type(annotations), re.Pattern, json.JSONDecoder, json.JSONEncoder)


def two(sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> tuple[TaskApp, TaskApp]:
    """Two apps, each with its Outbox, strict outside a transaction (a send nothing bound is refused)."""
    return (TaskApp(sessions, clock, tables, f"iso-a-{uuid.uuid4().hex[:8]}", enqueue_outside_transaction="raise"),
            TaskApp(sessions, clock, tables, f"iso-b-{uuid.uuid4().hex[:8]}", enqueue_outside_transaction="raise"))


def written(t: TaskApp) -> list[str]:
    """The first argument of each task row (an address), in write order."""
    return [r.payload["body"][0][0] for r in t.rows()]


def test_one_outboxs_transaction_is_not_anothers(any_sessions: sessionmaker[Session], clock: ManualClock,
                                                 tables: Tables) -> None:
    a, b = two(any_sessions, clock, tables)
    # Given outbox A's transaction bound
    with any_sessions.begin() as s, a.outbox.transaction(s):
        # Then outbox B sees nothing bound: its task is refused, not written into A's transaction
        assert b.outbox._enqueue_interceptor.bound.get() == ()
        with pytest.raises(TransactionRequiredError):
            b.mail.delay("refused@example.com")
        # When B binds a session of its own inside A's block (its task rolled back with it)
        with any_sessions() as s2, b.outbox.transaction(s2):
            b.mail.delay("rolled-back@example.com")
            s2.rollback()
            # Then A's task, sent while B's session is bound, still goes to A's session
            a.mail.delay("a@example.com")
    assert written(a) == ["a@example.com"]
    assert a.broker_messages() == [] and b.broker_messages() == []


def test_publishing_directly_is_one_apps_only(any_sessions: sessionmaker[Session], clock: ManualClock,
                                              tables: Tables) -> None:
    a, b = two(any_sessions, clock, tables)
    # Given both outboxes bound, and A publishing directly
    with any_sessions.begin() as s, a.outbox.transaction(s), b.outbox.transaction(s), publishing_directly(a.app):
        a.mail.delay("direct@example.com")
        b.mail.delay("row@example.com")
    # Then A's task went to the broker, B's is a row of the transaction
    assert len(a.broker_messages()) == 1 and b.broker_messages() == []
    assert written(b) == ["row@example.com"]


def test_a_dedup_record_is_one_outboxs_only(any_sessions: sessionmaker[Session], clock: ManualClock,
                                            tables: Tables) -> None:
    a, b = two(any_sessions, clock, tables)
    # Given A recording what its dedup writes did
    with any_sessions.begin() as s, a.outbox.transaction(s), b.outbox.transaction(s), \
            a.outbox._enqueue_interceptor.recording_dedup() as done:
        # When B writes a task with a dedup key, Then A's record does not see it
        b.mail.apply_async(("b@example.com",), headers={"outbox_dedup_key": "k-b"})
        assert done == []
        # And A's own write with a key is recorded
        a.mail.apply_async(("a@example.com",), headers={"outbox_dedup_key": "k-a"})
        assert [d.key for d in done] == ["k-a"]


def test_a_thread_started_inside_a_bound_block_sees_no_binding(any_sessions: sessionmaker[Session],
                                                               clock: ManualClock, tables: Tables) -> None:
    a, _ = two(any_sessions, clock, tables)
    seen: list[Any] = []

    def in_thread() -> None:
        try:
            a.mail.delay("thread@example.com")
        except TransactionRequiredError as e:
            seen.append(e)

    # Given A's transaction bound in this thread
    with any_sessions.begin() as s, a.outbox.transaction(s):
        a.mail.delay("main@example.com")
        # When another thread sends a task, Then it has no transaction of its own: refused
        worker = threading.Thread(target=in_thread)
        worker.start()
        worker.join(timeout=30)
    assert len(seen) == 1 and written(a) == ["main@example.com"]


def test_asyncio_tasks_each_keep_their_own_bound_transaction(any_sessions: sessionmaker[Session],
                                                             clock: ManualClock, tables: Tables) -> None:
    a, _ = two(any_sessions, clock, tables)

    async def main() -> None:
        second_bound, first_done = asyncio.Event(), asyncio.Event()

        async def first() -> None:
            with any_sessions() as s, a.outbox.transaction(s):
                await asyncio.wait_for(second_bound.wait(), timeout=30)
                a.mail.delay("committed@example.com")  # while the second request's session is bound too
                s.commit()
            first_done.set()

        async def second() -> None:
            with any_sessions() as s, a.outbox.transaction(s):
                second_bound.set()
                await asyncio.wait_for(first_done.wait(), timeout=30)
                a.mail.delay("rolled-back@example.com")
                s.rollback()

        await asyncio.gather(first(), second())

    # When two interleaved asyncio requests bind their own sessions, one commits and one rolls back
    asyncio.run(main())
    # Then each task went to its own request's session: only the committed one's row exists
    assert written(a) == ["committed@example.com"]


def test_no_module_of_the_celery_binding_keeps_mutable_state() -> None:
    # Given every module under celery_outbox/celery/
    names = [m.name for m in pkgutil.iter_modules(celery_outbox.celery.__path__, "celery_outbox.celery.")]
    assert "celery_outbox.celery.enqueue" in names
    state = {}
    for name in names:
        module = importlib.import_module(name)
        for key, value in vars(module).items():
            if key.startswith("__") or isinstance(value, (types.ModuleType, type, types.FunctionType,
                                                          types.BuiltinFunctionType, *IMMUTABLE)):
                continue
            if isinstance(value, logging.Logger) or typing.get_origin(value) is not None:
                continue  # loggers are logging's (configured per process by design); type aliases are immutable
            if not type(value).__module__.startswith("celery_outbox") and type(value).__module__.startswith("celery"):
                continue  # Celery's own objects imported by name (its signals)
            state[f"{name}.{key}"] = type(value).__name__
    # Then none holds a list, a dict, a set, a lock, a context variable or any other object of its own
    assert state == {}
