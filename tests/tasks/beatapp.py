"""An app with one periodic task through the outbox (``outbox.periodic``), built only on the public API.

``celery -A tests.tasks.beatapp beat|worker`` and ``outbox -A tests.tasks.beatapp relay`` load it; the
environment names the broker, the database, the queue and the period (``BEATAPP_EVERY_S``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from celery import Celery
from kombu import Exchange, Queue
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from celery_outbox import Outbox, Settings


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "beatapp_runs"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(sa.String(64))


@dataclass
class BeatApp:
    outbox: Outbox
    sessions: sessionmaker[Session]
    metadata: sa.MetaData

    def create_schema(self) -> None:
        engine = self.sessions.kw["bind"]
        self.metadata.create_all(engine)
        Base.metadata.create_all(engine)

    def runs(self) -> list[Run]:
        with self.sessions() as s:
            return list(s.execute(sa.select(Run).order_by(Run.id)).scalars())


def build(broker_url: str, database_url: str, queue: str, *, every_s: float) -> BeatApp:
    engine = sa.create_engine(database_url)
    sessions = sessionmaker(engine)
    app = Celery("beatapp", broker=broker_url, set_as_current=False)
    app.conf.update(task_routes={"beatapp.*": {"queue": queue}}, broker_connection_retry_on_startup=True,
                    task_queues=[Queue(queue, Exchange(queue), routing_key=queue, durable=True)],
                    accept_content=["json"], task_serializer="json", worker_hijack_root_logger=False,
                    beat_schedule={})
    settings = Settings(database_url=database_url, broker_url=broker_url, namespace=queue.replace(".", "-"),
                        relay_poll_interval_s=1.0)
    outbox = Outbox(app, engine=engine, settings=settings)
    # only the periodic task under test: beat here does not drive the relay (a separate `outbox relay` does)
    app.conf.beat_schedule = {}
    metadata = sa.MetaData()
    outbox.define_tables(metadata)

    @app.task(name="beatapp.tick", bind=True, shared=False)  # type: ignore[untyped-decorator]
    def tick(self: Any) -> None:
        with sessions.begin() as s:
            s.add(Run(task_id=str(self.request.id)))

    outbox.periodic("tick", "beatapp.tick", every_s)
    return BeatApp(outbox=outbox, sessions=sessions, metadata=metadata)


_built = build(os.environ.get("BEATAPP_BROKER_URL", "memory://"), os.environ.get("BEATAPP_DATABASE_URL", "sqlite://"),
               os.environ.get("BEATAPP_QUEUE", "beatapp.q"), every_s=float(os.environ.get("BEATAPP_EVERY_S", "6")))
outbox = _built.outbox
app = outbox.app
