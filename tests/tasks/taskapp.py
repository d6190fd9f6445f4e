"""A tiny app that enqueues Celery tasks through the outbox, built only on the public API.

``celery -A tests.tasks.taskapp worker`` and ``outbox -A tests.tasks.taskapp relay --once`` load it;
its broker, database and queue come from ``TASKAPP_BROKER_URL``, ``TASKAPP_DATABASE_URL`` and
``TASKAPP_QUEUE``. A test process builds its own copy with ``build(...)`` (same tasks, same routes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from celery_outbox import Outbox, Settings


class Base(DeclarativeBase):
    pass


class Greeting(Base):
    """What the task does: one row per run (a test counts them)."""

    __tablename__ = "taskapp_greetings"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(sa.String(64))
    text: Mapped[str] = mapped_column(sa.String(200))


@dataclass
class TaskApp:
    outbox: Outbox
    sessions: sessionmaker[Session]
    greet: Any
    metadata: sa.MetaData

    def create_schema(self) -> None:
        engine = self.sessions.kw["bind"]
        self.metadata.create_all(engine)
        Base.metadata.create_all(engine)


def build(broker_url: str, database_url: str, queue: str) -> TaskApp:
    engine = sa.create_engine(database_url)
    sessions = sessionmaker(engine)
    app = Celery("taskapp", broker=broker_url, set_as_current=False)
    app.conf.update(task_routes={"taskapp.greet": {"queue": queue}}, broker_connection_retry_on_startup=True,
                    accept_content=["json"], task_serializer="json", worker_hijack_root_logger=False)
    outbox = Outbox(app, engine=engine, settings=Settings(database_url=database_url, broker_url=broker_url,
                                                          namespace=queue.replace(".", "-")))
    metadata = sa.MetaData()
    outbox.define_tables(metadata)

    @app.task(name="taskapp.greet", bind=True, shared=False)  # type: ignore[untyped-decorator]
    def greet(self: Any, name: str, *, punctuation: str = "!") -> str:
        text = f"hello {name}{punctuation}"
        with sessions.begin() as s:
            s.add(Greeting(task_id=str(self.request.id), text=text))
        return text

    return TaskApp(outbox=outbox, sessions=sessions, greet=greet, metadata=metadata)


_built = build(os.environ.get("TASKAPP_BROKER_URL", "memory://"), os.environ.get("TASKAPP_DATABASE_URL", "sqlite://"),
               os.environ.get("TASKAPP_QUEUE", "taskapp.greetings"))
outbox = _built.outbox
app = outbox.app
