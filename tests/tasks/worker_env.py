"""Real processes around ``tests.tasks.idempotent_app`` on Postgres and a real broker, for tests/tasks and tests/chaos.

``task_env(...)`` yields an ``Env`` that starts real ``celery worker``, ``outbox relay`` and enqueuing
processes (configured only through ``OUTBOX_*`` variables, like a deployment), counts calls and effects,
and stops every process it started (by its own id) when the block ends.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from kombu import Connection, Exchange, Queue
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import counters
from celery_outbox.celery.enqueue import publishing_directly
from celery_outbox.counters import DUPLICATES
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.schema import Tables
from celeryconfig import Settings
from devtools.processes import Child, settings_env
from tests.tasks import idempotent_app as ia

ROOT = Path(__file__).resolve().parents[2]
OUTBOX_CLI = str(Path(sys.executable).with_name("outbox"))
KILLED = -9


@dataclass
class Env:
    settings: Settings
    built: ia.TaskApp
    sessions: sessionmaker[Session]
    tables: Tables
    tmp: Path
    workers: list[Child]
    others: list[Child]

    def child_env(self, crash_points: str = "") -> dict[str, str]:
        return settings_env(self.settings, broker_url=self.settings.broker_url,
                            extra={"OUTBOX_CRASH_POINTS": crash_points})

    def node(self, index: int) -> str:
        return f"idem-{self.settings.namespace}-{index}@{socket.gethostname()}"

    def start_worker(self, *, crash_points: str = "", heartbeat: bool = False,
                     extra_queues: Sequence[str] = ()) -> Child:
        """A prefork worker (one pool process) on the tasks queue (and ``extra_queues``); ``heartbeat`` for
        Flower to see it online."""
        queue = ",".join([ia.tasks_queue(self.built.settings), *extra_queues])
        argv = [sys.executable, "-m", "celery", "-A", "tests.tasks.idempotent_app", "worker", "-Q", queue,
                "-P", "prefork", "-c", "1", "--without-gossip", "--without-mingle",
                *([] if heartbeat else ["--without-heartbeat"]),
                "-n", f"idem-{self.settings.namespace}-{len(self.workers)}@%h", "-l", "INFO"]
        child = Child(name="worker", argv=argv, env=self.child_env(crash_points),
                      log_path=self.tmp / f"worker-{len(self.workers)}.log", cwd=ROOT).start()
        self.workers.append(child)
        return child

    def start_relay(self, *, crash_points: str = "", once: bool = False) -> Child:
        """The real standalone relay of this app (``outbox -A tests.tasks.idempotent_app:outbox relay``)."""
        argv = [OUTBOX_CLI, "-A", "tests.tasks.idempotent_app:outbox", "relay", "--no-listen",
                *(["--once"] if once else ["--poll-interval", "0.3"])]
        return self._other("relay", argv, crash_points)

    def start_flower(self, port: int) -> Child:
        """A real Flower on this app's broker, its HTTP API open on 127.0.0.1:``port``."""
        argv = [sys.executable, "-m", "celery", "-A", "tests.tasks.idempotent_app", "flower", f"--port={port}",
                "--address=127.0.0.1"]
        child = Child(name="flower", argv=argv, env={**self.child_env(), "FLOWER_UNAUTHENTICATED_API": "true"},
                      log_path=self.tmp / "flower.log", cwd=ROOT).start()
        self.others.append(child)
        return child

    def start_enqueuer(self, keys: Sequence[str], *, crash_points: str = "") -> Child:
        """An application process enqueuing ``idem.record`` and ``plain.record`` per key (tests/tasks/enqueuer.py)."""
        return self._other("enqueuer", [sys.executable, "-m", "tests.tasks.enqueuer", *keys], crash_points)

    def _other(self, name: str, argv: list[str], crash_points: str) -> Child:
        child = Child(name=name, argv=argv, env=self.child_env(crash_points),
                      log_path=self.tmp / f"{name}-{len(self.others)}.log", cwd=ROOT).start()
        self.others.append(child)
        return child

    def exit_code(self, child: Child, *, timeout_s: float = 60) -> int | None:
        """Wait for ``child`` to end; its exit code (negative: killed by that signal)."""
        assert child.proc is not None
        try:
            return child.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def send(self, task: object, *args: object, task_id: str, copies: int = 1) -> None:
        """Publish the task message ``copies`` times, same task id (a relay duplicate, a redelivery)."""
        with publishing_directly(task.app):  # type: ignore[attr-defined]
            for _ in range(copies):
                task.apply_async(args=list(args), task_id=task_id)  # type: ignore[attr-defined]

    def logs(self) -> str:
        return "\n".join(f"--- {c.log_path.name} ---\n{c.log_tail(80)}" for c in [*self.others, *self.workers])

    def wait(self, what: str, observe: Callable[[Session], object], expected: object, timeout_s: float = 90) -> None:
        """Poll ``observe`` until it returns ``expected`` (a wait, not a timing assertion)."""
        deadline = time.monotonic() + timeout_s
        last: object = None
        while time.monotonic() < deadline:
            with self.sessions() as s:
                last = observe(s)
            if last == expected:
                return
            if any(not w.alive for w in self.workers[-1:]):
                pytest.fail(f"the worker exited while waiting for {what}\n{self.logs()}")
            time.sleep(0.25)
        pytest.fail(f"timed out waiting for {what}: expected {expected!r}, last {last!r}\n{self.logs()}")

    def duplicates(self, s: Session, key: str) -> int:
        return counters.value(s, key, DUPLICATES, tables=self.tables)

    def calls(self, task: str, key: str) -> int:
        return ia.calls(self.built.settings, task, key)

    def pending(self) -> int:
        outbox = self.tables.outbox
        with self.sessions() as s:
            return int(s.execute(sa.select(sa.func.count()).select_from(outbox)
                                 .where(outbox.published_at_ms.is_(None))).scalar_one())

    def rows(self) -> int:
        with self.sessions() as s:
            return int(s.execute(sa.select(sa.func.count()).select_from(self.tables.outbox)).scalar_one())


@contextmanager
def task_env(*, broker_url: str, pg_url: str, namespace: str, tmp_path: Path, tables: Tables) -> Iterator[Env]:
    """An ``Env`` on the given Postgres database and broker (Redis or RabbitMQ), under its own namespace and home."""
    home = tmp_path / "home"
    home.mkdir()
    settings = Settings(home=home, database_url=pg_url, broker_url=broker_url, namespace=namespace, routes={},
                        consumer_retry_backoff_s=1, consumer_retry_backoff_max_s=2)
    engine = make_engine(pg_url)
    ia.metadata.create_all(engine)
    built = ia.build(settings, broker_url=broker_url)
    built.outbox._tables = tables
    e = Env(settings=settings, built=built, sessions=make_session_factory(engine), tables=tables, tmp=tmp_path,
            workers=[], others=[])
    try:
        yield e
    finally:
        for c in [*e.others, *e.workers]:
            c.stop()
        queue = ia.tasks_queue(built.settings)
        with Connection(broker_url) as conn:
            Queue(queue, Exchange(queue), routing_key=queue)(conn.channel()).delete()
        ia.metadata.drop_all(engine)  # the session's shared Postgres database keeps only its own tables
        built.app.close()
        engine.dispose()
