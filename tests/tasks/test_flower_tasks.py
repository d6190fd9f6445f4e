"""Tasks enqueued through the outbox, as a real Flower lists them through its HTTP API (``/api/tasks``).

A real ``celery -A tests.tasks.idempotent_app flower`` and a real prefork worker (task events off, as
``celeryconfig.celery_config`` leaves them: Flower turns them on) on Postgres and a real broker, Redis
and RabbitMQ. The test process enqueues an ``@outbox.task`` and a plain ``@app.task`` inside a
transaction; the real ``outbox relay --once`` publishes the rows. Flower must list each one under its
task id (= the outbox message id), with its real task name and its arguments, as SUCCESS: nothing about
the outbox detour shows.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_outbox.schema import Tables
from tests.support.workers import TASK_EVENTS_BY_REMOTE
from tests.tasks import idempotent_app as ia
from tests.tasks.worker_env import Env, task_env

pytestmark = [pytest.mark.postgres, pytest.mark.workers, pytest.mark.slow]


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
def env(request: pytest.FixtureRequest, pg_url: str, namespace: str, tmp_path: Path, tables: Tables) -> Iterator[Env]:
    broker_url: str = request.getfixturevalue(f"{request.param}_url")
    with task_env(broker_url=broker_url, pg_url=pg_url, namespace=namespace, tmp_path=tmp_path, tables=tables) as e:
        yield e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get(base: str, path: str) -> Any:
    with urllib.request.urlopen(base + path, timeout=10) as r:
        return json.loads(r.read())


def wait(env: Env, what: str, probe: Callable[[], tuple[bool, object]], timeout_s: float = 120) -> None:
    """Poll ``probe`` (Flower's API) until it says done; a wait, not a timing assertion."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        for c in [*env.others, *env.workers]:
            if c.name in ("flower", "worker") and not c.alive:
                pytest.fail(f"{c.log_path.name} exited while waiting for {what}\n{env.logs()}")
        try:
            ok, last = probe()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            ok, last = False, e
        if ok:
            return
        time.sleep(0.3)
    pytest.fail(f"timed out waiting for {what}; last {last!r}\n{env.logs()}")


def test_flower_lists_outbox_enqueued_tasks_by_name_with_their_args(env: Env) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env.start_flower(port)
    wait(env, "Flower's API", lambda: (isinstance(get(base, "/api/tasks"), dict), "up"))
    # Given Flower listening to a worker's events (it has seen the worker come online)
    worker = env.start_worker(heartbeat=True)
    node = env.node(0)
    wait(env, "Flower to see the worker", lambda: (node in get(base, "/api/workers?refresh=true"),
                                                   get(base, "/api/workers")))
    wait(env, "Flower to turn the worker's task events on",
         lambda: (TASK_EVENTS_BY_REMOTE in worker.log_path.read_text(errors="replace"), "not in the worker's log yet"))
    # When a view enqueues one idempotent and one plain task in its transaction, and the relay publishes them
    with env.sessions.begin() as s, env.built.outbox.transaction(s):
        idem = env.built.record.delay("fl-1")
        plain = env.built.plain.apply_async(("fl-2",))
    relay = env.start_relay(once=True)
    assert env.exit_code(relay) == 0, env.logs()

    # Then Flower lists both under their task ids, by their real names, with their arguments, succeeded
    def listed() -> tuple[bool, object]:
        tasks: dict[str, dict[str, Any]] = get(base, "/api/tasks")
        seen = {tid: (t.get("name"), t.get("args"), t.get("state"), t.get("worker"))
                for tid, t in tasks.items() if tid in (idem.id, plain.id)}
        return seen == {idem.id: (ia.RECORD, "('fl-1',)", "SUCCESS", node),
                        plain.id: (ia.PLAIN, "('fl-2',)", "SUCCESS", node)}, seen

    wait(env, "both tasks in Flower", listed)
    # And the single task's view answers the same for the id the outbox gave it
    one = get(base, f"/api/task/info/{idem.id}")
    assert (one["name"], one["args"], one["kwargs"]) == (ia.RECORD, "('fl-1',)", "{}")
