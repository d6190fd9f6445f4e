"""A tiny app that enqueues Celery tasks through the outbox, built only on the public API.

``celery -A tests.tasks.taskapp worker`` and ``outbox -A tests.tasks.taskapp relay --once`` load it;
its broker, database and queue come from ``TASKAPP_BROKER_URL``, ``TASKAPP_DATABASE_URL`` and
``TASKAPP_QUEUE``. A test process builds its own copy with ``build(...)`` (same tasks, same routes);
the app itself is wired by tests/tasks/outbox_app.py.
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from tests.tasks.outbox_app import OutboxApp, build_outbox_app


class Base(DeclarativeBase):
    pass


class Greeting(Base):
    """What the task does: one row per run (a test counts them)."""

    __tablename__ = "taskapp_greetings"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(sa.String(64))
    text: Mapped[str] = mapped_column(sa.String(200))


class TaskApp(OutboxApp[Greeting]):
    model = Greeting

    @property
    def greet(self) -> Any:
        return self.tasks["taskapp.greet"]


def build(broker_url: str, database_url: str, queue: str) -> TaskApp:
    t = build_outbox_app(TaskApp, "taskapp", broker_url=broker_url, database_url=database_url, queue=queue,
                         routes="taskapp.greet")

    @t.app.task(name="taskapp.greet", bind=True, shared=False)  # type: ignore[untyped-decorator]
    def greet(self: Any, name: str, *, punctuation: str = "!") -> str:
        text = f"hello {name}{punctuation}"
        with t.sessions.begin() as s:
            s.add(Greeting(task_id=str(self.request.id), text=text))
        return text

    t.tasks["taskapp.greet"] = greet
    return t


_built = build(os.environ.get("TASKAPP_BROKER_URL", "memory://"), os.environ.get("TASKAPP_DATABASE_URL", "sqlite://"),
               os.environ.get("TASKAPP_QUEUE", "taskapp.greetings"))
outbox = _built.outbox
app = outbox.app
