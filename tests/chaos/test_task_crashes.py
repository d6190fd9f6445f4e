"""Crash points on the TASK path (transactional enqueue, issue #12), each provoked in real processes.

Real ``python -m tests.tasks.enqueuer`` (the application), real ``outbox relay`` and a real prefork
``celery worker`` of ``tests.tasks.idempotent_app`` on Postgres and Redis, SIGKILLed at named crash
points (``OUTBOX_CRASH_POINTS``). ``idem.record`` is an ``@outbox.task`` (its effect commits with its
inbox row); ``plain.record`` is a plain ``@app.task`` that commits its effect on its own.

The third row, a worker SIGKILLed after its commit and before its ack, is proven in
tests/tasks/test_idempotent_worker.py (``test_worker_killed_after_commit_before_ack_effect_once`` and
``test_plain_task_killed_after_commit_before_ack_runs_twice``); it is not repeated here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from celery_outbox.schema import Tables
from tests.tasks import idempotent_app as ia
from tests.tasks.enqueuer import ENQUEUED
from tests.tasks.worker_env import KILLED, Env, task_env

pytestmark = [pytest.mark.chaos, pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]


@pytest.fixture
def env(redis_url: str, pg_url: str, namespace: str, tmp_path: Path, tables: Tables) -> Iterator[Env]:
    with task_env(broker_url=redis_url, pg_url=pg_url, namespace=namespace, tmp_path=tmp_path, tables=tables) as e:
        yield e


def pairs(keys: list[str]) -> list[tuple[str, str]]:
    return [(task, key) for task in (ia.RECORD, ia.PLAIN) for key in keys]


def effects(s: Session, keys: list[str]) -> dict[tuple[str, str], int]:
    """Effect rows per (task, key), for the idempotent and the plain task."""
    return {(task, key): ia.effect_count(s, task, key) for task, key in pairs(keys)}


def test_enqueuer_killed_after_commit_relay_publishes_later_each_task_runs_once(env: Env) -> None:
    keys = ["a1", "a2", "a3"]
    # Given: an application process that enqueues two tasks per key and is SIGKILLed right after its
    # 2nd commit, with no relay running (nothing can have been published yet)
    enqueuer = env.start_enqueuer(keys, crash_points="after_enqueue_commit@2")
    assert env.exit_code(enqueuer) == KILLED, env.logs()
    # Then: the two committed transactions left their data and their task rows, pending; the third never ran
    assert env.rows() == 4
    assert env.pending() == 4
    with env.sessions() as s:
        assert [ia.effect_count(s, ENQUEUED, k) for k in keys] == [1, 1, 0]
    # When: the relay and a worker start later
    env.start_worker()
    env.start_relay()
    # Then: every committed task runs, once (the plain one too: nothing was published twice)
    committed = keys[:2]
    env.wait("each committed task's effect", lambda s: effects(s, committed), dict.fromkeys(pairs(committed), 1))
    env.wait("the outbox drained", lambda s: env.pending(), 0)
    for key in committed:
        assert (env.calls(ia.RECORD, key), env.calls(ia.PLAIN, key)) == (1, 1)
    with env.sessions() as s:
        assert env.duplicates(s, env.built.record.outbox_task_key) == 0
        assert ia.effect_count(s, ia.RECORD, "a3") + ia.effect_count(s, ia.PLAIN, "a3") == 0


def test_relay_killed_after_publish_before_mark_idempotent_once_plain_twice(env: Env) -> None:
    keys = ["b1", "b2"]
    enqueuer = env.start_enqueuer(keys)
    assert env.exit_code(enqueuer) == 0, env.logs()
    assert env.pending() == 4
    env.start_worker()
    # Given: a relay SIGKILLed after the broker took the batch, before it marked the rows published
    relay = env.start_relay(crash_points="after_publish_before_mark")
    assert env.exit_code(relay) == KILLED, env.logs()
    assert env.pending() == 4
    # When: the relay restarts and publishes the same four task messages again (same task ids)
    again = env.start_relay(once=True)
    assert env.exit_code(again) == 0, env.logs()
    assert env.pending() == 0
    # Then: the @outbox.task absorbed its second copy (one effect, one call, one duplicate per key)...
    key = env.built.record.outbox_task_key
    env.wait("both copies of each idempotent task handled",
             lambda s: ([ia.effect_count(s, ia.RECORD, k) for k in keys], env.duplicates(s, key)), ([1, 1], 2))
    # ...and the plain @app.task ran twice per key: documented (docs/failure-matrix.md), what @outbox.task prevents
    env.wait("each plain task's two effects", lambda s: [ia.effect_count(s, ia.PLAIN, k) for k in keys], [2, 2])
    for k in keys:
        assert (env.calls(ia.RECORD, k), env.calls(ia.PLAIN, k)) == (1, 2)
