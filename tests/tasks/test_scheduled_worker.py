"""Real workers, a real relay: a task sent with a countdown runs once, at its time (docs/scheduled.md).

The app is ``tests/tasks/schedapp.py`` (public API only) on a SQLite file shared by the test, the relay
(``outbox -A tests.tasks.schedapp relay``, polling, no NOTIFY on SQLite) and a ``celery worker``.

- Redis with the visibility timeout shortened to 2 s: a countdown of 6 s, three visibility timeouts.
  The control is the same task sent straight to the broker as plain Celery sends it (``eta`` in the
  message): the worker holds it unacked, Redis hands it out again after each visibility timeout, and it
  runs more than once. Held in the outbox, it runs once, after its due time, with no eta.
- RabbitMQ with the task's queue a quorum queue (``x-queue-type: quorum``): a countdown task runs once,
  after its due time, with no eta (the worker never holds it).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from kombu import Connection, Exchange, Queue

from celery_outbox.celery.enqueue import publishing_directly
from devtools.processes import Child, wait_until
from tests.tasks.schedapp import SchedApp, build

pytestmark = [pytest.mark.workers, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
VISIBILITY_S = 2


def start(tmp_path: Path, env: dict[str, str], queue: str) -> tuple[Child, Child]:
    worker = Child(name="worker", cwd=ROOT, env=env, log_path=tmp_path / "worker.log", argv=[
        sys.executable, "-m", "celery", "-A", "tests.tasks.schedapp", "worker", "-Q", queue, "-P", "solo",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO", "-n", f"{queue}@%h"]).start()
    relay = Child(name="relay", cwd=ROOT, env=env, log_path=tmp_path / "relay.log",
                  argv=[str(BIN / "outbox"), "-A", "tests.tasks.schedapp", "relay", "--no-listen"]).start()
    return worker, relay


@pytest.fixture
def run_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({"SCHEDAPP_DATABASE_URL": f"sqlite:///{tmp_path / 'sched.db'}", "PYTHONPATH": str(ROOT),
                "SCHEDAPP_QUEUE": f"sched.{uuid.uuid4().hex[:10]}"})
    yield env


def app_of(env: dict[str, str]) -> SchedApp:
    return build(env["SCHEDAPP_BROKER_URL"], env["SCHEDAPP_DATABASE_URL"], env["SCHEDAPP_QUEUE"],
                 visibility_s=int(env.get("SCHEDAPP_VISIBILITY_S", "300")), quorum=env.get("SCHEDAPP_QUORUM") == "1")


def delete_queue(url: str, queue: str) -> None:
    with Connection(url) as conn:
        channel = conn.channel()
        Queue(queue, Exchange(queue), routing_key=queue)(channel).delete()


@pytest.mark.redis
def test_redis_a_countdown_longer_than_the_visibility_timeout_runs_once_when_held_in_the_outbox(
        redis_url: str, run_env: dict[str, str], tmp_path: Path) -> None:
    env = {**run_env, "SCHEDAPP_BROKER_URL": redis_url, "SCHEDAPP_VISIBILITY_S": str(VISIBILITY_S)}
    t = app_of(env)
    t.create_schema()
    worker, relay = start(tmp_path, env, env["SCHEDAPP_QUEUE"])
    try:
        # Given a worker and a relay running, and the same 6 s countdown task sent twice: through the
        # outbox, and (the control) straight to the broker as plain Celery sends it
        countdown_s = 3 * VISIBILITY_S
        with t.sessions.begin() as s, t.outbox.transaction(s):
            held = t.remind.apply_async(("held",), countdown=countdown_s)
        with publishing_directly(t.remind.app):
            direct = t.remind.apply_async(("direct",), countdown=countdown_s)
        with t.sessions() as s:
            [row] = s.execute(sa.select(t.outbox.tables.outbox)).scalars().all()
        due = row.next_attempt_at_ms

        def runs(task_id: str) -> list[int]:
            return [r.ran_at_ms for r in t.runs() if r.task_id == task_id]

        # When both are due and run, and three more visibility timeouts pass
        assert wait_until(lambda: len(runs(held.id)) >= 1 and len(runs(direct.id)) >= 2, timeout_s=90), (
            f"held {runs(held.id)} direct {runs(direct.id)}\n{worker.log_tail()}\n{relay.log_tail()}")
        time.sleep(3 * VISIBILITY_S + 1)  # an absence check: a redelivery would come within this
        # Then the control ran more than once (Redis redelivered the eta message the worker held) ...
        assert len(runs(direct.id)) >= 2
        # ... and the task held in the outbox ran once, after its due time, without an eta
        [ran_at] = runs(held.id)
        assert ran_at >= due
        assert [r.eta for r in t.runs() if r.task_id == held.id] == [None]
    finally:
        relay.stop()
        worker.stop()
        delete_queue(redis_url, env["SCHEDAPP_QUEUE"])


@pytest.mark.rabbitmq
def test_rabbitmq_quorum_queue_a_countdown_task_runs_once_at_its_time(rabbitmq_url: str, run_env: dict[str, str],
                                                                       tmp_path: Path) -> None:
    env = {**run_env, "SCHEDAPP_BROKER_URL": rabbitmq_url, "SCHEDAPP_QUORUM": "1"}
    t = app_of(env)
    t.create_schema()
    worker, relay = start(tmp_path, env, env["SCHEDAPP_QUEUE"])
    try:
        # Given a worker on a quorum queue and a relay running
        assert wait_until(lambda: "ready." in worker.log_path.read_text(errors="replace"), timeout_s=60), \
            worker.log_tail()
        # When a task with a 3 s countdown is committed
        with t.sessions.begin() as s, t.outbox.transaction(s):
            held = t.remind.apply_async(("held",), countdown=3)
        with t.sessions() as s:
            [row] = s.execute(sa.select(t.outbox.tables.outbox)).scalars().all()
        assert row.headers["queue"]["arguments"] == {"x-queue-type": "quorum"}
        # Then it runs, once, after its due time, without an eta (the worker never held it)
        assert wait_until(lambda: len(t.runs()) >= 1, timeout_s=60), worker.log_tail() + relay.log_tail()
        time.sleep(3)  # an absence check: a second delivery would come within this
        [run] = t.runs()
        assert run.task_id == held.id and run.ran_at_ms >= row.next_attempt_at_ms and run.eta is None
    finally:
        relay.stop()
        worker.stop()
        delete_queue(rabbitmq_url, env["SCHEDAPP_QUEUE"])
