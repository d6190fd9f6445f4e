"""A rolling deploy with two worker generations and a web process of the new one (docs/scheduled.md,
"Deploys"): 0 lost, 0 discarded, every task run once by a worker that knows it; on Redis and RabbitMQ.

The app is ``tests/deploy/deployapp.py`` (public API only) on a SQLite file shared by the test, the relay
(``outbox -A tests.deploy.deployapp relay``) and the ``celery worker`` of each generation. Generation 1
runs ``deploy.charge`` (version 1); generation 2 runs ``deploy.charge`` at version 2 (new arguments) and
the new task ``deploy.charge_v2``. Workers register in the worker registry (heartbeat 500 ms here).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from kombu import Connection, Exchange, Queue

from celery_outbox.clock import SystemClock
from celery_outbox.ops import stats as ops_stats
from devtools.processes import Child, wait_until
from tests.deploy.deployapp import DeployApp, build

pytestmark = [pytest.mark.workers, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HEARTBEAT_MS, RECHECK_MS = 500, 300


@pytest.fixture
def run_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({"DEPLOYAPP_DATABASE_URL": f"sqlite:///{tmp_path / 'deploy.db'}", "PYTHONPATH": str(ROOT),
                "DEPLOYAPP_QUEUE": f"deploy.{uuid.uuid4().hex[:10]}",
                "OUTBOX_WORKER_HEARTBEAT_MS": str(HEARTBEAT_MS), "OUTBOX_RELAY_HOLD_RECHECK_MS": str(RECHECK_MS)})
    yield env


def worker(tmp_path: Path, env: dict[str, str], generation: int) -> Child:
    return Child(name=f"worker{generation}", cwd=ROOT, env={**env, "DEPLOYAPP_GENERATION": str(generation)},
                 log_path=tmp_path / f"worker{generation}.log", argv=[
                     sys.executable, "-m", "celery", "-A", "tests.deploy.deployapp", "worker", "-Q",
                     env["DEPLOYAPP_QUEUE"], "-P", "solo", "--without-gossip", "--without-mingle",
                     "--without-heartbeat", "-l", "INFO", "-n", f"gen{generation}@%h"]).start()


def registered(t: DeployApp) -> list[dict[str, int]]:
    """The task tables of the registered workers."""
    with t.sessions() as s:
        return [dict(tasks) for tasks in s.execute(sa.select(t.outbox.tables.workers.tasks)).scalars()]


def delete_queue(url: str, queue: str) -> None:
    with Connection(url) as conn:
        Queue(queue, Exchange(queue), routing_key=queue)(conn.channel()).delete()


def rolling_deploy(broker_url: str, run_env: dict[str, str], tmp_path: Path) -> None:
    env = {**run_env, "DEPLOYAPP_BROKER_URL": broker_url}
    queue = env["DEPLOYAPP_QUEUE"]
    settings = {"worker_heartbeat_ms": HEARTBEAT_MS, "relay_hold_recheck_ms": RECHECK_MS}
    old_web = build(broker_url, env["DEPLOYAPP_DATABASE_URL"], queue, generation=1)
    new_web = build(broker_url, env["DEPLOYAPP_DATABASE_URL"], queue, generation=2)
    for t in (old_web, new_web):
        t.outbox.settings = t.outbox.settings.replace(**settings)
    new_web.create_schema()
    gen1 = worker(tmp_path, env, 1)
    relay = Child(name="relay", cwd=ROOT, env=env, log_path=tmp_path / "relay.log",
                  argv=[str(BIN / "outbox"), "-A", "tests.deploy.deployapp", "relay", "--no-listen"]).start()
    gen2: Child | None = None

    def logs() -> str:
        return "\n".join(c.log_tail() for c in (gen1, relay, gen2) if c is not None)

    try:
        # Given generation 1's worker running (registered) and a relay
        assert wait_until(lambda: registered(new_web) == [{"deploy.charge": 1}], timeout_s=60), logs()
        # When an old web process enqueues the old task, and a new web process the new version and a new task
        with old_web.sessions.begin() as s, old_web.outbox.transaction(s):
            old = [old_web.tasks["deploy.charge"].delay(f"o{i}").id for i in range(3)]
        with new_web.sessions.begin() as s, new_web.outbox.transaction(s):
            new = [new_web.tasks["deploy.charge"].delay(f"n{i}", 100 * i).id for i in range(3)]
            new += [new_web.tasks["deploy.charge_v2"].delay(f"v{i}").id for i in range(3)]

        def ran() -> Counter[str]:
            return Counter(r.task_id for r in new_web.runs())

        # Then generation 1 runs the old tasks, and the relay holds the new ones for a worker that runs them,
        # charging no attempt, shown in stats
        assert wait_until(lambda: all(ran()[i] for i in old), timeout_s=60), logs()
        time.sleep(5 * RECHECK_MS / 1000)  # several hold rechecks
        assert not any(ran()[i] for i in new), logs()
        o = new_web.outbox.tables.outbox
        with new_web.sessions() as s:
            held = s.execute(sa.select(o.held_for, o.attempts, o.dead_lettered_at_ms)
                             .where(o.published_at_ms.is_(None))).all()
            st = ops_stats.collect(s, tables=new_web.outbox.tables, clock=SystemClock())
        assert sorted(held) == sorted([(f"waiting for a worker that runs deploy.charge v2 on queue {queue}", 0, None)] * 3
                                      + [(f"waiting for a worker that runs deploy.charge_v2 on queue {queue}", 0, None)] * 3)
        assert sorted((w.what, w.count) for w in st.waiting_for_worker) == [
            (f"deploy.charge v2 on queue {queue}", 3), (f"deploy.charge_v2 on queue {queue}", 3)]
        assert st.scheduled == 0
        # When generation 2 starts beside generation 1 (the rolling deploy's overlap)
        gen2 = worker(tmp_path, env, 2)
        assert wait_until(lambda: len(registered(new_web)) == 2, timeout_s=60), logs()
        time.sleep(5 * RECHECK_MS / 1000)
        # Then nothing new goes out while a live worker of the queue (generation 1) cannot run it
        assert not any(ran()[i] for i in new), logs()
        # When generation 1 stops (warm shutdown: it leaves the registry)
        assert gen1.stop() is not None
        # Then every held task goes out and generation 2 runs each once
        assert wait_until(lambda: all(ran()[i] for i in new), timeout_s=60), logs()
        time.sleep(2)  # an absence check: a second run would come within this
        runs = new_web.runs()
        counts = Counter(r.task_id for r in runs)
        assert sorted(counts) == sorted(old + new) and set(counts.values()) == {1}
        assert {r.task_id: r.generation for r in runs} == {**{i: 1 for i in old}, **{i: 2 for i in new}}
        with new_web.sessions() as s:
            rows = s.execute(sa.select(o.published_at_ms, o.attempts, o.dead_lettered_at_ms)).all()
            dead = s.scalar(sa.select(sa.func.count()).select_from(new_web.outbox.tables.dead_letters))
        assert len(rows) == 9 and all(p is not None and a == 0 and d is None for p, a, d in rows)
        assert dead == 0
        for child in (gen1, gen2):
            text = child.log_path.read_text(errors="replace")
            assert "unregistered" not in text.lower() and "discarded" not in text.lower(), text[-3000:]
    finally:
        relay.stop()
        gen1.stop()
        if gen2 is not None:
            gen2.stop()
        delete_queue(broker_url, queue)


@pytest.mark.redis
def test_redis_rolling_deploy_holds_new_tasks_until_every_live_worker_runs_them(
        redis_url: str, run_env: dict[str, str], tmp_path: Path) -> None:
    rolling_deploy(redis_url, run_env, tmp_path)


@pytest.mark.rabbitmq
def test_rabbitmq_rolling_deploy_holds_new_tasks_until_every_live_worker_runs_them(
        rabbitmq_url: str, run_env: dict[str, str], tmp_path: Path) -> None:
    rolling_deploy(rabbitmq_url, run_env, tmp_path)
