"""A real ``celery worker`` on Redis and on RabbitMQ runs tasks enqueued through the outbox.

The app is ``tests/tasks/taskapp.py`` (public API only) on a SQLite file shared by the test, the relay
and the worker. The relay is the real CLI, ``outbox -A tests.tasks.taskapp relay --once`` (kombu
publisher, confirms per batch on RabbitMQ), run BEFORE the worker starts: the message waits in the
task's queue, which the relay declared (nothing else had), and the worker then runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from devtools.processes import wait_until
from tests.support.workers import stop_process
from tests.tasks.taskapp import Greeting, build

pytestmark = [pytest.mark.workers, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
def broker_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url


def test_real_worker_runs_the_committed_task_and_never_the_rolled_back_one(broker_url: str, tmp_path: Path) -> None:
    queue = f"taskapp.{uuid.uuid4().hex[:10]}"
    database_url = f"sqlite:///{tmp_path / 'taskapp.db'}"
    env = {**os.environ, "TASKAPP_BROKER_URL": broker_url, "TASKAPP_DATABASE_URL": database_url,
           "TASKAPP_QUEUE": queue, "PYTHONPATH": str(ROOT)}
    for key in [k for k in env if k.startswith("OUTBOX_")]:
        del env[key]
    t = build(broker_url, database_url, queue)
    t.create_schema()

    # Given one view that enqueues and rolls back, and one that enqueues and commits
    with pytest.raises(RuntimeError), t.sessions.begin() as s, t.outbox.transaction(s):
        t.greet.delay("rolled back")
        raise RuntimeError("the view failed")
    with t.sessions.begin() as s, t.outbox.transaction(s):
        committed = t.greet.apply_async(("ada",), {"punctuation": "?"})

    # When the real relay publishes, then a real worker consumes the task's queue
    relay = subprocess.run([str(BIN / "outbox"), "-A", "tests.tasks.taskapp", "relay", "--once", "--no-listen"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert relay.returncode == 0, relay.stdout + relay.stderr
    assert "published 1," in relay.stdout
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.tasks.taskapp", "worker", "-Q", queue, "-P", "solo",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO", "-n", f"{queue}@%h"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def greetings() -> list[tuple[str, str]]:
            with t.sessions() as s:
                return [(g.task_id, g.text) for g in s.execute(sa.select(Greeting)).scalars()]

        # Then the committed task runs, with its id, name and arguments; the rolled-back one never existed
        assert wait_until(lambda: bool(greetings()), timeout_s=60), log.read_text(errors="replace")[-4000:]
        assert greetings() == [(committed.id, "hello ada?")]
        text = log.read_text(errors="replace")
        assert f"Task taskapp.greet[{committed.id}] received" in text
    finally:
        stop_process(worker, timeout_s=20)
    with t.sessions() as s:
        assert s.execute(sa.select(sa.func.count()).select_from(Greeting)).scalar_one() == 1
