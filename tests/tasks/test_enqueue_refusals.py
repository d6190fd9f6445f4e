"""``.delay()`` refuses inside the caller's transaction what the database or the worker would refuse later.

Each refusal is a ``ValidationError`` naming what is wrong, raised inside the caller's transaction,
with nothing written (the caller's own work can still commit); a UUID task id in another spelling
is normalised instead and runs. SQLite and Postgres (on Postgres NUL in JSON and a reused id were a
raw driver error at the caller's commit; arguments 999 deep were a ``RecursionError``).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import ManualClock, Tables, ValidationError
from celery_outbox.testing import drain
from tests.tasks.test_enqueue import TaskApp


@pytest.fixture
def tasks(any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> TaskApp:
    return TaskApp(any_sessions, clock, tables, f"refuse-{uuid.uuid4().hex[:8]}", max_json_depth=16)


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


def refused(tasks: TaskApp, match: str, send: Any) -> None:
    """``send()`` inside a transaction raises ValidationError(match); the caller's other row still commits."""
    with tasks.sessions() as s:
        with tasks.outbox.transaction(s):
            tasks.mail.delay("kept@example.com")
            with pytest.raises(ValidationError, match=match) as info:
                send()
            assert "nothing was written" in str(info.value)
            assert "\x00" not in str(info.value) and "\n" not in str(info.value)
        s.commit()  # the caller's transaction is intact: its own work commits, the refused task is not there
    assert [r.payload["body"][0] for r in tasks.rows()] == [["kept@example.com"]]
    with tasks.sessions.begin() as s:
        s.execute(sa.delete(tasks.tables.outbox))


def test_arguments_nested_too_deep_are_refused_not_a_recursion_error(tasks: TaskApp) -> None:
    for depth in (17, 999, 5000):
        refused(tasks, "argument 1 is nested deeper than 16 levels", lambda d=depth: tasks.mail.delay(nested(d)))
    refused(tasks, "keyword argument 'subject' is nested deeper", lambda: tasks.mail.delay("a", subject=nested(17)))


def test_nul_and_lone_surrogates_are_refused_before_the_database_sees_them(tasks: TaskApp) -> None:
    match = "NUL character or a lone surrogate"
    refused(tasks, match, lambda: tasks.mail.delay("a\x00b"))
    refused(tasks, match, lambda: tasks.mail.delay("\ud800"))
    refused(tasks, match, lambda: tasks.mail.apply_async(("a",), {"subject": "\udfff"}))
    refused(tasks, match, lambda: tasks.mail.apply_async(("a",), headers={"tenant": "a\x00"}))


def test_a_task_id_an_outbox_row_already_holds_is_refused(tasks: TaskApp) -> None:
    tid = str(uuid.uuid4())
    # Given a task committed with a task id the caller chose
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        tasks.mail.apply_async(("first@example.com",), task_id=tid)
    # When the same id is used again, in any spelling, Then it is refused at the call
    refused_twice = f"has task_id '{tid}', which an outbox row already holds"
    with tasks.sessions() as s, tasks.outbox.transaction(s):
        for spelling in (tid, tid.upper(), "{" + tid + "}"):
            with pytest.raises(ValidationError, match=refused_twice):
                tasks.mail.apply_async(("again@example.com",), task_id=spelling)
    # And twice in one transaction (the first not flushed yet) is refused at the second call
    other = str(uuid.uuid4())
    with tasks.sessions() as s, tasks.outbox.transaction(s):
        tasks.mail.apply_async(("one@example.com",), task_id=other)
        with pytest.raises(ValidationError, match="already holds"):
            tasks.mail.apply_async(("two@example.com",), task_id=other)
        s.commit()
    assert sorted(str(r.message_id) for r in tasks.rows()) == sorted([tid, other])


def test_celery_made_task_ids_cost_no_query(tasks: TaskApp) -> None:
    # Given a statement counter on the database
    engine = tasks.sessions.kw["bind"]
    seen: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not statement.upper().startswith("BEGIN"):  # SQLite's own transaction start
            seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        with tasks.sessions() as s, tasks.outbox.transaction(s):
            # When tasks are sent with Celery's own ids
            for i in range(5):
                tasks.mail.delay(f"{i}@example.com")
            # Then each cost its row's INSERT and nothing else (no reused-id lookup)
            assert [st.lstrip().upper().split()[:2] for st in seen] == [["INSERT", "INTO"]] * 5
            # And a chosen id costs one lookup before its INSERT
            seen.clear()
            tasks.mail.apply_async(("chosen@example.com",), task_id=str(uuid.uuid4()))
            assert [st.lstrip().upper().split()[0] for st in seen] == ["SELECT", "INSERT"]
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)


def test_uuid_spellings_are_normalised_and_the_relay_publishes_them(tasks: TaskApp) -> None:
    ids = [uuid.uuid4() for _ in range(4)]
    spellings = [str(ids[0]).upper(), ids[1].hex, "{" + str(ids[2]) + "}", ids[3].urn]
    # Given tasks sent with task ids in four other spellings of a UUID
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        for spelling in spellings:
            tasks.mail.apply_async(("a@example.com",), task_id=spelling)
    # Then each row and its Celery message carry the canonical spelling
    assert sorted(str(r.message_id) for r in tasks.rows()) == sorted(str(u) for u in ids)
    assert all(r.headers["task_headers"]["id"] == str(r.message_id) for r in tasks.rows())
    # And the relay publishes every one (none is dead-lettered for an id that does not match its row)
    result = drain(tasks.outbox)
    assert sorted(m.headers["id"] for m in result.published) == sorted(str(u) for u in ids)
    assert all(r.dead_lettered_at_ms is None for r in tasks.rows())


def test_arguments_that_do_not_fit_the_task_are_refused_when_sent_by_name(tasks: TaskApp) -> None:
    # Celery checks .delay() itself (TypeError); send_task by name skipped that check until now
    refused(tasks, "arguments do not fit task enq.step", lambda: tasks.app.send_task("enq.step", args=[1, 2, 3]))
