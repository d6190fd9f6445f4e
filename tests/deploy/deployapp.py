"""Two generations of one app for the rolling-deploy test, built only on the public API (docs/scheduled.md,
"Deploys").

- generation 1 runs ``deploy.charge`` (an ``@outbox.task``, unversioned: version 1);
- generation 2 runs ``deploy.charge`` at ``version=2`` (its message format changed) and the new plain task
  ``deploy.charge_v2``.

Every run is a row ``(task id, task name, generation)``. ``celery -A tests.deploy.deployapp worker`` and
``outbox -A tests.deploy.deployapp relay`` load it; the environment names the generation
(``DEPLOYAPP_GENERATION``), the broker, the database and the queue; a test process builds its own copies
with ``build(...)``, wired by tests/tasks/outbox_app.py.
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from tests.tasks.outbox_app import OutboxApp, build_outbox_app


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "deployapp_runs"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(sa.String(64))
    name: Mapped[str] = mapped_column(sa.String(100))
    generation: Mapped[int] = mapped_column(sa.Integer)


class DeployApp(OutboxApp[Run]):
    model = Run


def build(broker_url: str, database_url: str, queue: str, *, generation: int) -> DeployApp:
    t = build_outbox_app(DeployApp, f"deployapp{generation}", broker_url=broker_url, database_url=database_url,
                         queue=queue, routes="deploy.*", default_queue=True, broker_visibility_timeout_s=30,
                         relay_poll_interval_s=1.0)
    outbox, sessions = t.outbox, t.sessions

    if generation == 1:
        @outbox.task(name="deploy.charge")
        def charge(session: Session, order: str) -> None:
            from celery import current_task
            session.add(Run(task_id=str(current_task.request.id), name="deploy.charge", generation=1))

        t.tasks["deploy.charge"] = charge
    else:
        @outbox.task(name="deploy.charge", version=2)
        def charge2(session: Session, order: str, amount_cents: int) -> None:  # the new message format
            from celery import current_task
            session.add(Run(task_id=str(current_task.request.id), name="deploy.charge", generation=2))

        @t.app.task(name="deploy.charge_v2", bind=True, shared=False)  # type: ignore[untyped-decorator]
        def charge_v2(self: Any, order: str) -> None:
            with sessions.begin() as s:
                s.add(Run(task_id=str(self.request.id), name="deploy.charge_v2", generation=2))

        t.tasks["deploy.charge"] = charge2
        t.tasks["deploy.charge_v2"] = charge_v2
    return t


_built = build(os.environ.get("DEPLOYAPP_BROKER_URL", "memory://"), os.environ.get("DEPLOYAPP_DATABASE_URL", "sqlite://"),
               os.environ.get("DEPLOYAPP_QUEUE", "deployapp.q"), generation=int(os.environ.get("DEPLOYAPP_GENERATION", "2")))
outbox = _built.outbox
app = outbox.app
