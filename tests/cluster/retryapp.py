"""Two event consumers whose handlers fail on purpose, on the library's own Celery configuration.

``celery -A tests.cluster.retryapp worker`` builds it from the ``OUTBOX_*`` variables on first access of
``app`` (importing this module builds nothing). Routes: ``Flaky`` to ``flaky`` (fails on its first
``FAILURES`` deliveries of a message, then succeeds), ``Broken`` to ``broken`` (always fails). Each call
is counted in a file under ``RETRYAPP_HOME`` (append-only: several pool processes write one file), and the
worker's main process appends, for each message it receives, the routing key the broker delivered it with
and the queues that dead-lettered it on the way (RabbitMQ's ``x-death`` header), so a test sees which way
each retry travelled: the consumer task sees a delivery the library rebuilt (celery/strategy.py), the
broker's own message is behind it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from celery import Celery
from celery.signals import task_received
from sqlalchemy.orm import Session

from celery_outbox import Envelope, Outbox, Settings
from celery_outbox.celery.config import celery_config

FAILURES = 2
ROUTES = {"Flaky": ("flaky",), "Broken": ("broken",)}

metadata = sa.MetaData()
effects = sa.Table(
    "retryapp_effects", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("message_id", sa.String(64), nullable=False),
)


def calls_file(home: Path, consumer: str, message_id: str) -> Path:
    return home / "calls" / f"{consumer}-{message_id}"


def calls(home: Path, consumer: str, message_id: str) -> int:
    """How many times the handler ran for this message."""
    path = calls_file(home, consumer, message_id)
    return len(path.read_text().splitlines()) if path.exists() else 0


def _record_call(home: Path, consumer: str, message_id: str) -> int:
    path = calls_file(home, consumer, message_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write("call\n")
    return len(path.read_text().splitlines())


def received_file(home: Path) -> Path:
    return home / "received"


def received(home: Path) -> list[tuple[str, str, tuple[str, ...]]]:
    """``(task id, routing key, dead-lettered from)`` of each message the worker received, in order."""
    path = received_file(home)
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        tid, key, deaths = line.split(" ")
        out.append((tid, key, tuple(d for d in deaths.split(",") if d)))
    return out


def _on_received(home: Path, request: Any) -> None:
    raw = getattr(request.message, "_original", request.message)  # the broker's message behind the rebuilt one
    info = getattr(raw, "delivery_info", None) or {}
    deaths = [str(d.get("queue")) for d in (getattr(raw, "headers", None) or {}).get("x-death") or []]
    path = received_file(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(f"{request.id} {info.get('routing_key') or '-'} {','.join(deaths)}\n")


def build(settings: Settings, home: Path) -> Outbox:
    settings = settings.replace(routes=ROUTES)
    app = Celery("retryapp", set_as_current=False)
    app.conf.update(celery_config(settings, settings.broker_url))
    outbox = Outbox(app, settings=settings)
    task_received.connect(lambda sender=None, request=None, **kw: _on_received(home, request), weak=False)

    @outbox.consumer("Flaky", name="flaky")
    def flaky(session: Session, event: Envelope) -> None:
        session.execute(effects.insert().values(message_id=str(event.message_id)))  # rolled back on failure
        if _record_call(home, "flaky", str(event.message_id)) <= FAILURES:
            raise ConnectionError("downstream timed out")

    @outbox.consumer("Broken", name="broken")
    def broken(session: Session, event: Envelope) -> None:
        _record_call(home, "broken", str(event.message_id))
        raise ValueError("cannot handle this one")

    return outbox


_built: dict[str, Outbox] = {}


def __getattr__(name: str) -> Any:
    if name not in ("app", "outbox"):
        raise AttributeError(name)
    if "env" not in _built:
        settings = Settings.from_env()
        _built["env"] = build(settings.replace(database_url=settings.effective_database_url),
                              Path(os.environ["RETRYAPP_HOME"]))
    outbox = _built["env"]
    return {"app": outbox.app, "outbox": outbox}[name]
