"""Idempotent tasks (``@outbox.task``) and one plain ``@app.task``, for tests/tasks: in-process and in a real worker.

``celery -A tests.tasks.idempotent_app worker -Q <namespace>.tasks`` and ``outbox -A
tests.tasks.idempotent_app:outbox ...`` build it from the ``OUTBOX_*`` variables on first access of
``app``/``outbox``, so importing this module in a test builds nothing. Calls are counted in files
under ``Settings.home`` (append-only, so several worker processes count into one file, and no second
database connection competes with the task's own on SQLite).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from celery import Celery
from kombu import Exchange, Queue
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Clock, Outbox
from celery_outbox.celery.config import add_task_routes
from celeryconfig import Settings, celery_config

metadata = sa.MetaData()
effects = sa.Table(
    "idem_effects", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("task", sa.String(50), nullable=False),
    sa.Column("key", sa.String(100), nullable=False),
)

RECORD = "idem.record"
FLAKY = "idem.flaky"
BROKEN = "idem.broken"
PLAIN = "plain.record"
CRASH_POINT = "consumer_after_commit_before_ack"  # where inbox.handle crashes after its commit


def tasks_queue(settings: Settings) -> str:
    return f"{settings.namespace}.tasks"


def plain_queue(settings: Settings) -> str:
    """A second queue the app declares (nothing routes to it): hostile tests publish a plain task's messages there."""
    return f"{settings.namespace}.plain"


def calls_file(settings: Settings, task: str, key: str) -> Path:
    return Path(settings.home) / "calls" / f"{task}-{key}"


def count_call(settings: Settings, task: str, key: str) -> int:
    """Count one call of ``task`` for ``key``; returns how many there were, this one included."""
    path = calls_file(settings, task, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as f:
        f.write(b"x")
    return path.stat().st_size


def calls(settings: Settings, task: str, key: str) -> int:
    path = calls_file(settings, task, key)
    return path.stat().st_size if path.exists() else 0


def fix(settings: Settings, key: str) -> None:
    """From now on ``idem.broken`` succeeds for ``key`` (the operator fixed what made it fail)."""
    (Path(settings.home) / f"fixed-{key}").touch()


def effect_count(session: Session, task: str, key: str | None = None) -> int:
    stmt = sa.select(sa.func.count()).select_from(effects).where(effects.c.task == task)
    if key is not None:
        stmt = stmt.where(effects.c.key == key)
    return int(session.execute(stmt).scalar_one())


@dataclass
class TaskApp:
    settings: Settings
    outbox: Outbox
    record: Any
    flaky: Any
    broken: Any
    plain: Any

    @property
    def app(self) -> Celery:
        return self.outbox.app


def build(settings: Settings, *, broker_url: str | None = None, session_factory: sessionmaker[Session] | None = None,
          clock: Clock | None = None) -> TaskApp:
    settings = settings.replace(routes={})  # no consumers here: only tasks
    app = Celery("idempotent-tasks", set_as_current=False)
    app.conf.update(celery_config(settings, broker_url or settings.broker_url))
    queue = tasks_queue(settings)
    second = plain_queue(settings)
    app.conf.task_queues = [*app.conf.task_queues, Queue(queue, Exchange(queue), routing_key=queue, durable=True),
                            Queue(second, Exchange(second), routing_key=second, durable=True)]
    add_task_routes(app, {RECORD: {"queue": queue}, FLAKY: {"queue": queue}, BROKEN: {"queue": queue},
                          PLAIN: {"queue": queue}})
    box = Outbox(app, settings=settings, session_factory=session_factory, clock=clock)
    @box.task(name=RECORD, max_retries=2, retry_backoff=1, retry_backoff_max=2)
    def record(session: Session, key: str) -> str:
        count_call(settings, RECORD, key)
        session.execute(effects.insert().values(task=RECORD, key=key))
        return key

    @box.task(name=FLAKY, max_retries=3, retry_backoff=1, retry_backoff_max=2)
    def flaky(session: Session, key: str, *, failures: int = 2) -> str:
        session.execute(effects.insert().values(task=FLAKY, key=key))  # rolled back with the failure
        if count_call(settings, FLAKY, key) <= failures:
            raise ConnectionError(f"downstream timed out ({key})")
        return key

    @box.task(name=BROKEN, max_retries=1, retry_backoff=1, retry_backoff_max=2)
    def broken(session: Session, key: str) -> str:
        count_call(settings, BROKEN, key)
        session.execute(effects.insert().values(task=BROKEN, key=key))
        if not (Path(settings.home) / f"fixed-{key}").exists():
            raise ValueError(f"cannot handle {key} until it is fixed")
        return key

    @app.task(name=PLAIN, bind=True, shared=False)  # type: ignore[untyped-decorator]
    def plain(self: Any, key: str) -> str:
        """NOT idempotent: commits its effect itself, with no inbox row."""
        count_call(settings, PLAIN, key)
        with box.sessions()() as s:
            s.execute(effects.insert().values(task=PLAIN, key=key))
            s.commit()
            first = effect_count(s, PLAIN, key) == 1
        if first:  # the same crash window as the idempotent task's, once (the redelivery must finish)
            box.crash_points.reached(CRASH_POINT)
        return key

    return TaskApp(settings=settings, outbox=box, record=record, flaky=flaky, broken=broken, plain=plain)


def build_in_memory(*, home: Path, database_url: str, sessions: sessionmaker[Session], clock: Clock, tables: Any,
                    namespace: str) -> TaskApp:
    """The task app on a test's database and frozen clock, an in-memory broker, the session's table mapping."""
    settings = Settings(home=home, database_url=database_url, namespace=namespace, broker_url="memory://",
                        routes={})
    app = build(settings, session_factory=sessions, clock=clock)
    app.outbox._tables = tables
    return app


_built: dict[str, TaskApp] = {}


def __getattr__(name: str) -> Any:
    if name not in ("app", "outbox", "task_app"):
        raise AttributeError(name)
    if "env" not in _built:
        settings = Settings.from_env()
        _built["env"] = build(settings.replace(database_url=settings.effective_database_url))
    built = _built["env"]
    return {"app": built.app, "outbox": built.outbox, "task_app": built}[name]
