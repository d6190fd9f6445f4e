"""One way to build the small apps that real workers, beat and relays load in tests (tests/tasks/taskapp.py,
beatapp.py, schedapp.py, tests/deploy/deployapp.py): a Celery app speaking JSON with the app's queue
declared, an ``Outbox`` on the app's database, its tables, and the app's own models.

Each app module defines its models on a ``DeclarativeBase`` of its own, its tasks on the built app, and
what a test reads back; this module builds nothing on import (a worker loading one app gets that app only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import sqlalchemy as sa
from celery import Celery
from kombu import Exchange, Queue
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Outbox, Settings

R = TypeVar("R")


@dataclass
class OutboxApp(Generic[R]):
    """A built app: its outbox (and through it the Celery app), sessions on its database, the outbox's
    tables (``metadata``) and its tasks by name. Subclasses name the model of what their tasks record
    (``model``, rows of type ``R`` with an ``id``); its ``DeclarativeBase`` holds the app's tables."""

    model: ClassVar[type[Any]]
    outbox: Outbox
    sessions: sessionmaker[Session]
    metadata: sa.MetaData
    tasks: dict[str, Any] = field(default_factory=dict)

    @property
    def app(self) -> Celery:
        return self.outbox.app

    def create_schema(self) -> None:
        """The outbox's tables and the app's own, on the app's database."""
        engine = self.sessions.kw["bind"]
        self.metadata.create_all(engine)
        self.model.metadata.create_all(engine)

    def runs(self) -> list[R]:
        """What the tasks recorded, oldest first."""
        with self.sessions() as s:
            return list(s.execute(sa.select(self.model).order_by(self.model.id)).scalars())


A = TypeVar("A", bound=OutboxApp[Any])


def build_outbox_app(cls: type[A], name: str, *, broker_url: str, database_url: str, queue: str, routes: str,
                     quorum: bool = False, default_queue: bool = False, **settings: Any) -> A:
    """``cls`` on a new Celery app ``name`` whose tasks matching ``routes`` (a Celery route pattern) go to
    ``queue``, declared durable on an exchange of its own name (a RabbitMQ quorum queue with ``quorum``;
    every task's default queue with ``default_queue``), and an ``Outbox`` whose namespace is the queue's
    name; ``settings`` are further ``Settings`` fields (the relay's poll interval, Redis visibility)."""
    engine = sa.create_engine(database_url)
    app = Celery(name, broker=broker_url, set_as_current=False)
    arguments = {"x-queue-type": "quorum"} if quorum else None
    app.conf.update(task_routes={routes: {"queue": queue}}, broker_connection_retry_on_startup=True,
                    task_queues=[Queue(queue, Exchange(queue), routing_key=queue, durable=True,
                                       queue_arguments=arguments)],
                    accept_content=["json"], task_serializer="json", worker_hijack_root_logger=False)
    if default_queue:
        app.conf.task_default_queue = queue
    outbox = Outbox(app, engine=engine, settings=Settings(database_url=database_url, broker_url=broker_url,
                                                          namespace=queue.replace(".", "-"), **settings))
    metadata = sa.MetaData()
    outbox.define_tables(metadata)
    return cls(outbox=outbox, sessions=sessionmaker(engine), metadata=metadata)
