"""The relay as real processes: ``celery beat`` + ``celery worker`` running celery_outbox.drain
into consumer queues that the same worker consumes as ordinary Celery tasks, and ``outbox relay``
(the standalone loop) draining and stopping cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.clock import SystemClock

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

STUB_APP = textwrap.dedent('''
    """Test-only Celery app: the real relay task plus stub consumers.<name> tasks that log deliveries."""
    import json
    import os

    from celery import Celery

    from celery_outbox import Outbox
    from celeryconfig import Settings, celery_config

    settings = Settings.from_env()
    app = Celery("relay_stub", set_as_current=False)
    app.conf.update(celery_config(settings, settings.broker_url))
    outbox = Outbox(app, settings=settings)  # registers the real relay tasks on this app
    for event_type, names in settings.routes.items():
        outbox.route(event_type, *names)  # the consumers are the stubs below, not declared on the outbox
    OUT = os.environ["RELAY_TEST_OUT"]


    def make(consumer):
        @app.task(name="consumers." + consumer, bind=True)
        def handle(self, envelope):
            with open(OUT, "a") as f:
                f.write(json.dumps({"consumer": consumer, "message_id": envelope["message_id"],
                                    "task_id": self.request.id}) + "\\n")


    for c in settings.consumers:
        make(c)
''')


def insert(sessions: sessionmaker[Session], n: int, tables: Tables) -> set[str]:
    now = SystemClock().now_ms()
    ids = {uuid.uuid4() for _ in range(n)}
    with sessions() as s:
        for mid in ids:
            s.add(tables.outbox(message_id=mid, type="OrderPlaced", payload={"n": 1}, headers={},
                                created_at_ms=now, next_attempt_at_ms=now, attempts=0))
        s.commit()
    return {str(i) for i in ids}


def pending(sessions: sessionmaker[Session], tables: Tables) -> int:
    with sessions() as s:
        return int(s.scalar(sa.select(sa.func.count()).where(tables.outbox.published_at_ms.is_(None))) or 0)


class Procs:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.started: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.started.append((name, proc, log))
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {n} ---\n{log.read_text(errors='replace')[-4000:]}" for n, _, log in self.started)

    def kill_all(self) -> None:
        for _, proc, _ in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.kill_all()


@pytest.fixture
def redis_cleanup(redis_url: str, namespace: str) -> Iterator[None]:
    yield
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(f"{namespace}*")) + list(client.scan_iter(f"_kombu.binding.{namespace}*"))
    if keys:
        client.delete(*keys)


def wait_for(cond: Any, what: str, procs: Procs, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}\n{procs.logs()}")
        time.sleep(0.1)


def base_env(pg_url: str, redis_url: str, namespace: str, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(OUTBOX_DATABASE_URL=pg_url, OUTBOX_BROKER_URL=redis_url, OUTBOX_NAMESPACE=namespace,
               OUTBOX_HOME=str(home), OUTBOX_RELAY_POLL_INTERVAL_S="0.5", OUTBOX_APP="relay.app")
    return env


def test_beat_and_worker_drain_the_outbox_into_celery_consumer_tasks(
        pg_url: str, pg_sessions: sessionmaker[Session], redis_url: str, namespace: str, tmp_path: Path,
        procs: Procs, redis_cleanup: None, tables: Tables) -> None:
    # Given a real worker (relay queue + every consumer queue, stub consumer tasks) and real beat
    (tmp_path / "relay_stub.py").write_text(STUB_APP)
    out = tmp_path / "deliveries.jsonl"
    home = tmp_path / "home"
    home.mkdir()
    env = base_env(pg_url, redis_url, namespace, home)
    env.update(RELAY_TEST_OUT=str(out), PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    consumers = ("shipping", "billing", "search")  # OrderPlaced's consumers (celeryconfig.DEFAULT_ROUTES)
    queues = ",".join([f"{namespace}.relay", *(f"{namespace}.{c}" for c in consumers)])
    procs.start("worker", [str(BIN / "celery"), "-A", "relay_stub", "worker", "-P", "solo", "-Q", queues,
                           "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"],
                env, tmp_path)
    procs.start("beat", [str(BIN / "celery"), "-A", "relay_stub", "beat", "-l", "info",
                         "-s", str(home / "beat-schedule")], env, tmp_path)
    # When orders' outbox rows are committed
    ids = insert(pg_sessions, 5, tables)
    # Then beat's drain task publishes them and each consumer task runs once per message
    wait_for(lambda: pending(pg_sessions, tables) == 0, "the beat task to publish every row", procs)
    wait_for(lambda: out.exists() and len(out.read_text().splitlines()) >= len(ids) * len(consumers),
             "the consumer tasks to run", procs)
    seen = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(d["consumer"], d["message_id"]) for d in seen} == {(c, m) for c in consumers for m in ids}


def test_outbox_relay_process_drains_and_stops_on_sigterm(
        pg_url: str, pg_sessions: sessionmaker[Session], redis_url: str, namespace: str, tmp_path: Path,
        procs: Procs, redis_cleanup: None, tables: Tables) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = base_env(pg_url, redis_url, namespace, home)
    insert(pg_sessions, 3, tables)
    proc = procs.start("relay", [str(BIN / "outbox"), "relay", "--poll-interval", "3600"], env, REPO)
    wait_for(lambda: pending(pg_sessions, tables) == 0, "the first drain", procs)
    # When rows arrive while it sleeps for an hour, then NOTIFY wakes it
    insert(pg_sessions, 3, tables)
    wait_for(lambda: pending(pg_sessions, tables) == 0, "the notified drain", procs)
    # When SIGTERM arrives, then it stops cleanly (exit 0)
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"relay did not stop on SIGTERM\n{procs.logs()}")
    assert code == 0, procs.logs()
    assert "relay loop stopped" in procs.logs()
    client = redis.Redis.from_url(redis_url)
    assert client.llen(f"{namespace}.shipping") == 6
