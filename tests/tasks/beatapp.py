"""An app with one periodic task through the outbox (``outbox.periodic``), built only on the public API.

``celery -A tests.tasks.beatapp beat|worker`` and ``outbox -A tests.tasks.beatapp relay`` load it; the
environment names the broker, the database, the queue and the period (``BEATAPP_EVERY_S``). The app is
wired by tests/tasks/outbox_app.py.
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from tests.tasks.outbox_app import OutboxApp, build_outbox_app


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "beatapp_runs"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(sa.String(64))


class BeatApp(OutboxApp[Run]):
    model = Run


def build(broker_url: str, database_url: str, queue: str, *, every_s: float) -> BeatApp:
    t = build_outbox_app(BeatApp, "beatapp", broker_url=broker_url, database_url=database_url, queue=queue,
                         routes="beatapp.*", relay_poll_interval_s=1.0)
    # only the periodic task under test: beat here does not drive the relay (a separate `outbox relay` does)
    t.app.conf.beat_schedule = {}

    @t.app.task(name="beatapp.tick", bind=True, shared=False)  # type: ignore[untyped-decorator]
    def tick(self: Any) -> None:
        with t.sessions.begin() as s:
            s.add(Run(task_id=str(self.request.id)))

    t.tasks["beatapp.tick"] = tick
    t.outbox.periodic("tick", "beatapp.tick", every_s)
    return t


_built = build(os.environ.get("BEATAPP_BROKER_URL", "memory://"), os.environ.get("BEATAPP_DATABASE_URL", "sqlite://"),
               os.environ.get("BEATAPP_QUEUE", "beatapp.q"), every_s=float(os.environ.get("BEATAPP_EVERY_S", "6")))
outbox = _built.outbox
app = outbox.app
