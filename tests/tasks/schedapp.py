"""An app that sends scheduled tasks through the outbox, built only on the public API (docs/scheduled.md).

``celery -A tests.tasks.schedapp worker`` and ``outbox -A tests.tasks.schedapp relay`` load it; a test
process builds its own copy with ``build(...)``. From the environment: ``SCHEDAPP_BROKER_URL``,
``SCHEDAPP_DATABASE_URL``, ``SCHEDAPP_QUEUE``, ``SCHEDAPP_VISIBILITY_S`` (the Redis visibility timeout,
shortened so a test sees its redelivery) and ``SCHEDAPP_QUORUM=1`` (the task's queue is a RabbitMQ quorum
queue). The app is wired by tests/tasks/outbox_app.py.
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
    """One row per run of the task (a test counts them), with when it ran and the eta it was given."""

    __tablename__ = "schedapp_runs"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(sa.String(64))
    ran_at_ms: Mapped[int] = mapped_column(sa.BigInteger)
    eta: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)


class SchedApp(OutboxApp[Run]):
    model = Run

    @property
    def remind(self) -> Any:
        return self.tasks["schedapp.remind"]


def build(broker_url: str, database_url: str, queue: str, *, visibility_s: int = 300, quorum: bool = False) -> SchedApp:
    from celery_outbox.clock import SystemClock

    # A short visibility timeout needs retries and time limits below it (Settings.RELATIONS).
    below = 1 if visibility_s <= 60 else 60
    t = build_outbox_app(SchedApp, "schedapp", broker_url=broker_url, database_url=database_url, queue=queue,
                         routes="schedapp.remind", quorum=quorum, broker_visibility_timeout_s=visibility_s,
                         relay_poll_interval_s=1.0, consumer_retry_backoff_max_s=below, consumer_time_limit_s=below)

    @t.app.task(name="schedapp.remind", bind=True, shared=False)  # type: ignore[untyped-decorator]
    def remind(self: Any, who: str) -> None:
        with t.sessions.begin() as s:
            s.add(Run(task_id=str(self.request.id), ran_at_ms=SystemClock().now_ms(),
                      eta=None if self.request.eta is None else str(self.request.eta)))

    t.tasks["schedapp.remind"] = remind
    return t


_built = build(os.environ.get("SCHEDAPP_BROKER_URL", "memory://"), os.environ.get("SCHEDAPP_DATABASE_URL", "sqlite://"),
               os.environ.get("SCHEDAPP_QUEUE", "schedapp.reminders"),
               visibility_s=int(os.environ.get("SCHEDAPP_VISIBILITY_S", "300")),
               quorum=os.environ.get("SCHEDAPP_QUORUM") == "1")
outbox = _built.outbox
app = outbox.app
