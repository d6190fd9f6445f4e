"""Idempotent tasks in a real ``celery worker`` (prefork) on Redis and Postgres: redeliveries, retries,
dead letters and their CLI replay, and a worker SIGKILLed after its commit, before its ack.

The worker runs ``tests.tasks.idempotent_app`` (three ``@outbox.task`` tasks and one plain ``@app.task``);
messages are sent by the same app in this process, straight to the broker (``publishing_directly``: the
outbox's own relay path is tested in tests/tasks/test_enqueue*). Calls are counted in files, effects
and the inbox in Postgres.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_outbox.schema import Tables
from devtools.processes import settings_env
from tests.tasks import idempotent_app as ia
from tests.tasks.worker_env import OUTBOX_CLI, ROOT, Env, task_env

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]


@pytest.fixture
def env(redis_url: str, pg_url: str, namespace: str, tmp_path: Path, tables: Tables) -> Iterator[Env]:
    with task_env(broker_url=redis_url, pg_url=pg_url, namespace=namespace, tmp_path=tmp_path, tables=tables) as e:
        yield e


def test_same_task_message_delivered_twice_one_effect(env: Env) -> None:
    env.start_worker()
    tid = str(uuid.uuid4())
    # Given the same task message on the queue twice (a relay that re-published it)
    env.send(env.built.record, "d1", task_id=tid, copies=2)
    # When the worker takes both
    # Then the function ran once, its effect is there once, and the second copy was absorbed
    key = env.built.record.outbox_task_key
    env.wait("one effect and one duplicate absorbed",
             lambda s: (ia.effect_count(s, ia.RECORD, "d1"), env.duplicates(s, key)), (1, 1))
    assert env.calls(ia.RECORD, "d1") == 1


def test_fails_twice_then_succeeds_one_effect(env: Env) -> None:
    env.start_worker()
    # Given a task whose downstream fails twice (after writing its effect), then works
    env.send(env.built.flaky, "f1", task_id=str(uuid.uuid4()))
    # When the worker runs it and Celery retries it with the task's backoff
    env.wait("the effect", lambda s: ia.effect_count(s, ia.FLAKY, "f1"), 1)
    # Then it ran three times and the effect is there once (each failure rolled its writes back)
    assert env.calls(ia.FLAKY, "f1") == 3
    with env.sessions() as s:
        assert ia.effect_count(s, ia.FLAKY) == 1
        assert s.execute(sa.select(sa.func.count()).select_from(env.tables.attempts)).scalar_one() == 0


def test_always_failing_task_dead_lettered_then_cli_replay_runs_it_once(env: Env) -> None:
    env.start_worker()
    tid = str(uuid.uuid4())
    dead_letters = env.tables.dead_letters
    # Given a task (max_retries=1) that fails until someone fixes its cause
    env.send(env.built.broken, "b1", task_id=tid)
    # When it is delivered: tried max_retries + 1 = 2 times, then dead-lettered
    env.wait("the dead letter", lambda s: s.execute(sa.select(dead_letters.delivery_count)).scalars().all(), [2])
    with env.sessions() as s:
        row = s.execute(sa.select(dead_letters)).scalar_one()
        assert ia.effect_count(s, ia.BROKEN) == 0
    assert (row.consumer, row.message_id, row.type) == (env.built.broken.outbox_task_key, tid, ia.BROKEN)
    assert env.calls(ia.BROKEN, "b1") == 2
    # When the cause is fixed and an operator replays it with the CLI
    ia.fix(env.built.settings, "b1")
    cli_env = settings_env(env.settings, broker_url=env.settings.broker_url)
    done = subprocess.run([OUTBOX_CLI, "-A", "tests.tasks.idempotent_app:outbox", "dead-letters", "replay",
                           f"consumer:{row.id}"], cwd=ROOT, env=cli_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "re-sent as task 'idem.broken'" in done.stdout
    # Then the worker runs it once more, as the same task id: one effect
    env.wait("the replayed effect", lambda s: ia.effect_count(s, ia.BROKEN, "b1"), 1)
    assert env.calls(ia.BROKEN, "b1") == 3
    with env.sessions() as s:
        [inbox_row] = s.execute(sa.select(env.tables.inbox)).scalars().all()
        assert (str(inbox_row.message_id), inbox_row.consumer) == (tid, env.built.broken.outbox_task_key)
        assert s.execute(sa.select(dead_letters.replayed_at_ms)).scalar_one() is not None


def test_worker_killed_after_commit_before_ack_effect_once(env: Env) -> None:
    # Given a worker whose pool process SIGKILLs itself right after the task's commit, before the ack
    worker = env.start_worker(crash_points=ia.CRASH_POINT)
    tid = str(uuid.uuid4())
    key = env.built.record.outbox_task_key
    # When the task runs: its effect commits, the process dies, Redis hands the unacked message back
    env.send(env.built.record, "k1", task_id=tid)
    # Then the redelivery finds the inbox row: one effect, one duplicate absorbed
    env.wait("the redelivery absorbed as a duplicate",
             lambda s: (ia.effect_count(s, ia.RECORD, "k1"), env.duplicates(s, key)), (1, 1))
    assert env.calls(ia.RECORD, "k1") == 1
    log = worker.log_path.read_text(errors="replace")
    assert "WorkerLostError" in log and "signal 9" in log, env.logs()  # it really was killed


def test_plain_task_killed_after_commit_before_ack_runs_twice(env: Env) -> None:
    # Given a plain @app.task (not @outbox.task) that commits its effect itself, and the same crash
    worker = env.start_worker(crash_points=ia.CRASH_POINT)
    # When it runs: commit, SIGKILL before the ack, redelivery
    env.send(env.built.plain, "p1", task_id=str(uuid.uuid4()))
    # Then it ran twice and its effect is there twice: documented, and what @outbox.task prevents
    env.wait("two effects", lambda s: ia.effect_count(s, ia.PLAIN, "p1"), 2)
    assert env.calls(ia.PLAIN, "p1") == 2
    log = worker.log_path.read_text(errors="replace")
    assert "WorkerLostError" in log and "signal 9" in log, env.logs()
