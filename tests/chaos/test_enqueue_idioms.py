"""What ``.delay()`` with no transaction open (a script, a shell, code after the commit) guarantees, under a
SIGKILL between its commit and any publish (the default mode, ``own_transaction``).

A real ``python -m tests.tasks.script_enqueuer`` is SIGKILLed right after its 3rd ``delay()`` returned;
a real ``outbox relay`` and a real prefork ``celery worker`` (Postgres, Redis) start afterwards. Each
``delay()`` that returned left a committed row the relay publishes: the task runs once. Each ``delay()``
is its own transaction: the key whose second task was never sent has only its first.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_outbox.schema import Tables
from tests.tasks import idempotent_app as ia
from tests.tasks.worker_env import KILLED, Env, task_env

pytestmark = [pytest.mark.chaos, pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]


@pytest.fixture
def env(redis_url: str, pg_url: str, namespace: str, tmp_path: Path, tables: Tables) -> Iterator[Env]:
    with task_env(broker_url=redis_url, pg_url=pg_url, namespace=namespace, tmp_path=tmp_path, tables=tables) as e:
        yield e


def test_script_delay_killed_after_its_own_commit_is_published_later_and_runs_once(env: Env) -> None:
    keys = ["s1", "s2", "s3"]
    # Given: a script sending idem.record then plain.record per key with no transaction open, SIGKILLed right
    # after its 3rd delay() returned (s1 both, s2 idem.record only), with no relay running
    script = env._other("script", [sys.executable, "-m", "tests.tasks.script_enqueuer", *keys],
                        crash_points="after_enqueue_commit@3")
    assert env.exit_code(script) == KILLED, env.logs()
    # Then: three committed rows, pending; nothing reached the broker
    assert (env.rows(), env.pending()) == (3, 3)
    # When: the relay and a worker start later
    env.start_worker()
    env.start_relay()
    # Then: every delay() that returned runs exactly once; the one never called does not run
    expected = {(ia.RECORD, "s1"): 1, (ia.PLAIN, "s1"): 1, (ia.RECORD, "s2"): 1, (ia.PLAIN, "s2"): 0,
                (ia.RECORD, "s3"): 0, (ia.PLAIN, "s3"): 0}
    env.wait("each sent task's effect", lambda s: {k: ia.effect_count(s, *k) for k in expected}, expected)
    env.wait("the outbox drained", lambda s: env.pending(), 0)
    assert {k: env.calls(*k) for k in expected} == expected
