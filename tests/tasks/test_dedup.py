"""Deduplicate by key: at most one pending task per key, keep-first or replace, the caller's choice
(celery_outbox/dedup.py, docs/scheduled.md "Deduplicate by key"). SQLite and Postgres; on Postgres,
concurrent writers of one key in separate transactions.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from celery import group
from freezegun import freeze_time
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import ManualClock, NotFoundError, Tables, ValidationError
from celery_outbox.ops import dead_letters as dl
from celery_outbox.testing import InMemoryPublisher, drain
from tests.tasks.test_enqueue import TaskApp, body
from tests.tasks.test_scheduled import T0, T0_MS

KEY = "recompute-cart:42"


@pytest.fixture
def tasks(any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> TaskApp:
    clock.set(T0_MS)
    return TaskApp(any_sessions, clock, tables, f"dedup-{uuid.uuid4().hex[:8]}")


def keyed(key: str = KEY, on_conflict: str | None = None) -> dict[str, Any]:
    headers: dict[str, Any] = {"outbox_dedup_key": key}
    if on_conflict is not None:
        headers["outbox_dedup_on_conflict"] = on_conflict
    return {"headers": headers}


def pending(tasks: TaskApp) -> list[Any]:
    return [r for r in tasks.rows() if r.published_at_ms is None and r.dead_lettered_at_ms is None]


def test_keep_first_a_second_task_with_the_key_writes_nothing(tasks: TaskApp) -> None:
    # Given a task with key K, committed
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        first = tasks.mail.apply_async(("first@example.com",), **keyed())
    # When another task with K is sent (apply_async) and enqueued (outbox.enqueue), each in its own transaction
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        tasks.mail.apply_async(("second@example.com",), **keyed())
    with tasks.sessions.begin() as s:
        third = tasks.outbox.enqueue(s, tasks.mail.s("third@example.com"), dedup_key=KEY)
    # Then one row holds K, the first; outbox.enqueue answers with its id
    [row] = tasks.rows()
    assert str(row.message_id) == first.id == third.id and row.dedup_key == KEY
    # And the relay publishes the first task once, without the dedup headers on the message
    [m] = drain(tasks.outbox).published
    assert body(m)[0] == ["first@example.com"] and m.headers["id"] == first.id
    assert "outbox_dedup_key" not in m.headers and "outbox_dedup_on_conflict" not in m.headers


def test_replace_the_latest_task_with_the_key_wins(tasks: TaskApp, clock: ManualClock) -> None:
    # Given a task with key K held for 60 s
    with freeze_time(T0), tasks.sessions.begin() as s:
        first = tasks.outbox.enqueue(s, tasks.mail.s("first@example.com"), dedup_key=KEY, on_conflict="replace",
                                     countdown=60)
    # When a second one with K and a 30 s countdown replaces it
    with freeze_time(T0), tasks.sessions.begin() as s:
        second = tasks.outbox.enqueue(s, tasks.mail.s("second@example.com"), dedup_key=KEY, on_conflict="replace",
                                      countdown=30)
    # Then one row holds K: the second, due at its own eta; the first is gone (a cancel cannot find it)
    [row] = tasks.rows()
    assert (str(row.message_id), row.next_attempt_at_ms) == (second.id, T0_MS + 30_000) and second.id != first.id
    with tasks.sessions.begin() as s, pytest.raises(NotFoundError):
        tasks.outbox.cancel(s, first.id)
    # And when it is due the second is published, once
    clock.set(T0_MS + 30_000)
    assert drain(tasks.outbox).message_ids() == [second.id]
    clock.set(T0_MS + 120_000)
    assert drain(tasks.outbox).published == []


def test_in_one_transaction_the_key_is_kept_or_replaced_too(tasks: TaskApp) -> None:
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        tasks.mail.apply_async(("a@example.com",), **keyed())
        tasks.mail.apply_async(("b@example.com",), **keyed())
        last = tasks.mail.apply_async(("c@example.com",), **keyed(on_conflict="replace"))
    assert [str(r.message_id) for r in tasks.rows()] == [last.id]


def test_once_published_the_key_is_free_again(tasks: TaskApp) -> None:
    # Given a task with K the relay has published
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        first = tasks.mail.apply_async(("a@example.com",), **keyed())
    assert drain(tasks.outbox).message_ids() == [first.id]
    # When another task with K is sent, Then it is written and published too
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        second = tasks.mail.apply_async(("b@example.com",), **keyed())
    assert drain(tasks.outbox).message_ids() == [second.id]


def test_a_dead_lettered_task_gives_its_key_up_and_its_replay_does_not_conflict(tasks: TaskApp) -> None:
    # Given a task with K the broker rejects until the relay dead-letters it
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        dead = tasks.mail.apply_async(("a@example.com",), **keyed())
    publisher = InMemoryPublisher()
    publisher.reject(dead.id)
    for _ in range(tasks.outbox.settings.relay_max_attempts):
        tasks.outbox.clock.advance(3_600_000)  # type: ignore[attr-defined]
        drain(tasks.outbox, publisher)
    [row] = tasks.rows()
    assert row.dead_lettered_at_ms is not None and row.dedup_key is None and row.headers["outbox_dedup_key"] == KEY
    # When a new task with K is sent, Then it is written beside the dead one
    with tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        new = tasks.mail.apply_async(("b@example.com",), **keyed())
    assert [str(r.message_id) for r in pending(tasks)] == [new.id]
    # And the dead one can be replayed: both go out
    with tasks.sessions.begin() as s:
        dl.replay(s, [f"outbox:{row.seq}"], tables=tasks.tables, clock=tasks.outbox.clock)
    assert sorted(drain(tasks.outbox).message_ids()) == sorted([dead.id, new.id])


@pytest.mark.parametrize(("headers", "error"), [
    ({"outbox_dedup_key": ""}, "dedup key must be a printable string"),
    ({"outbox_dedup_key": "x" * 201}, "dedup key must be a printable string"),
    ({"outbox_dedup_key": "a\x00b"}, "dedup key must be a printable string"),
    ({"outbox_dedup_key": 42}, "dedup key must be a printable string"),
    ({"outbox_dedup_key": "k", "outbox_dedup_on_conflict": "merge"}, "on_conflict must be 'keep' or 'replace'"),
    ({"outbox_dedup_on_conflict": "keep"}, "without outbox_dedup_key"),
])
def test_a_bad_key_or_mode_is_refused_and_nothing_is_written(tasks: TaskApp, headers: dict[str, Any],
                                                            error: str) -> None:
    with pytest.raises(ValidationError, match=error), tasks.sessions.begin() as s, tasks.outbox.transaction(s):
        tasks.mail.apply_async(("a@example.com",), headers=headers)
    assert tasks.rows() == []


def test_enqueue_takes_a_key_for_one_task_only(tasks: TaskApp) -> None:
    with pytest.raises(ValidationError, match="not a chain or a group"), tasks.sessions.begin() as s:
        tasks.outbox.enqueue(s, tasks.step.s(1) | tasks.step.s(), dedup_key=KEY)
    assert tasks.rows() == []


@pytest.mark.parametrize("canvas", ["chain", "group"])
def test_a_key_in_the_headers_of_a_chain_or_group_is_refused_as_enqueue_refuses_it(tasks: TaskApp, canvas: str) -> None:
    # Given a chain (or a group) sent with a dedup key in its headers, as outbox.enqueue(..., dedup_key=K) refuses it
    sig = tasks.step.s(1) | tasks.step.s() if canvas == "chain" else group(tasks.step.s(1), tasks.step.s(2))
    # When it is sent inside a transaction, Then it is refused with the same words and nothing is written
    with pytest.raises(ValidationError, match="not a chain or a group"), tasks.sessions.begin() as s, \
            tasks.outbox.transaction(s):
        sig.apply_async(**keyed())
    assert tasks.rows() == []


# -- Postgres: concurrent writers of one key, each in its own transaction --------------------------------------------

@pytest.fixture
def pg_tasks(pg_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> TaskApp:
    clock.set(T0_MS)
    return TaskApp(pg_sessions, clock, tables, f"dedup-pg-{uuid.uuid4().hex[:8]}")


def blocked_on_a_lock(tasks: TaskApp) -> bool:
    with tasks.sessions() as s:
        return bool(s.scalar(sa.text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                     "AND datname = current_database()")))


def race(tasks: TaskApp, second: Callable[[Session], Any], *, first_commits: bool) -> tuple[Any, Any]:
    """Transaction 1 writes task ``a`` with the key and stays open; transaction 2 runs ``second`` (it must wait
    on the unique index); then transaction 1 commits or rolls back and transaction 2 commits."""
    out: dict[str, Any] = {}
    s1 = tasks.sessions()
    s1.begin()
    out["first"] = tasks.outbox.enqueue(s1, tasks.mail.s("a@example.com"), dedup_key=KEY)
    s1.flush()

    def run() -> None:
        try:
            with tasks.sessions.begin() as s2:
                out["second"] = second(s2)
        except BaseException as e:  # reported to the test below
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    for _ in range(500):
        if blocked_on_a_lock(tasks) or not t.is_alive():
            break
        threading.Event().wait(0.01)
    assert t.is_alive(), f"the second writer did not wait for the first: {out}"
    if first_commits:
        s1.commit()
    else:
        s1.rollback()
    s1.close()
    t.join(10)
    assert "error" not in out, out.get("error")
    return out["first"], out["second"]


@pytest.mark.postgres
def test_postgres_keep_a_concurrent_second_writer_waits_then_keeps_the_first(pg_tasks: TaskApp) -> None:
    first, second = race(pg_tasks, lambda s: pg_tasks.outbox.enqueue(s, pg_tasks.mail.s("b@example.com"),
                                                                     dedup_key=KEY), first_commits=True)
    assert [str(r.message_id) for r in pg_tasks.rows()] == [first.id] and second.id == first.id


@pytest.mark.postgres
def test_postgres_keep_when_the_first_writer_rolls_back_the_second_is_written(pg_tasks: TaskApp) -> None:
    first, second = race(pg_tasks, lambda s: pg_tasks.outbox.enqueue(s, pg_tasks.mail.s("b@example.com"),
                                                                     dedup_key=KEY), first_commits=False)
    assert [str(r.message_id) for r in pg_tasks.rows()] == [second.id] and second.id != first.id


@pytest.mark.postgres
def test_postgres_replace_a_concurrent_second_writer_waits_then_replaces_the_first(pg_tasks: TaskApp) -> None:
    first, second = race(pg_tasks, lambda s: pg_tasks.outbox.enqueue(
        s, pg_tasks.mail.s("b@example.com"), dedup_key=KEY, on_conflict="replace"), first_commits=True)
    assert [str(r.message_id) for r in pg_tasks.rows()] == [second.id] and second.id != first.id


@pytest.mark.postgres
def test_postgres_many_writers_of_few_keys_leave_one_pending_task_per_key(pg_tasks: TaskApp) -> None:
    # Given 8 threads each sending 25 tasks over 3 keys, half keep and half replace, in separate transactions
    errors: list[BaseException] = []
    ids: dict[str, set[str]] = {}
    lock = threading.Lock()

    def writer(n: int) -> None:
        try:
            for i in range(25):
                key = f"cart:{i % 3}"
                with pg_tasks.sessions.begin() as s:
                    r = pg_tasks.outbox.enqueue(s, pg_tasks.mail.s(f"{n}-{i}@example.com"), dedup_key=key,
                                                on_conflict="replace" if n % 2 else "keep")
                with lock:
                    ids.setdefault(key, set()).add(r.id)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # Then no writer failed, and exactly one pending row per key remains, one of the ids its writers were given
    assert errors == []
    rows = pending(pg_tasks)
    assert sorted(r.dedup_key for r in rows) == ["cart:0", "cart:1", "cart:2"]
    assert all(str(r.message_id) in ids[r.dedup_key] for r in rows)
