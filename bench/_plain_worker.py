"""Plain Celery as an application without the outbox runs it: Celery's DEFAULT configuration, both sides.

``celery -A bench._plain_worker worker`` is a Celery app built with nothing but its broker URL
(``OUTBOX_BROKER_URL``): no deployment configuration, no task gate, no consumer strategy, no inbox, no
publisher confirms, no events, tasks acknowledged before they run (``acks_late`` off), prefetch multiplier
4, JSON. Its tasks run the reference consumers' own ``prepare`` + handler (``consumers.default_registry``)
and the confirmation e-mail's ``send_confirmation`` through the same fake provider, each in one session
of a plain SQLAlchemy engine on ``OUTBOX_DATABASE_URL``, then commit: the same effects, without the
guarantee.

``plain_client`` is its sending side: ``send_task`` after the order's commit (what ``.delay()`` does),
Celery's defaults, optionally kombu's ``confirm_publish`` (RabbitMQ publisher confirms, the one knob
bench/sweep.py turns). Queues are named by the caller (``queue_names``), so several of these workers can
share a broker and a namespace without taking each other's messages.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

TASK_PREFIX = "plain."
EMAIL = "send_confirmation_email"


def task_names() -> tuple[str, ...]:
    """The consumers' names (shipping, billing, search) and the e-mail task's: one plain task and queue each."""
    from consumers import default_registry

    return (*(spec.name for spec in default_registry()), EMAIL)


def queue_names(prefix: str) -> dict[str, str]:
    return {name: f"{prefix}.{name}" for name in task_names()}


@functools.cache
def _sessions(pid: int) -> sessionmaker[Session]:
    """One plain engine per process (a prefork child builds its own after the fork)."""
    from celery_outbox.db import normalize_url

    return sessionmaker(sa.create_engine(normalize_url(os.environ["OUTBOX_DATABASE_URL"])))


def sessions() -> sessionmaker[Session]:
    return _sessions(os.getpid())


def build() -> Celery:
    from celery_outbox import Envelope
    from celery_outbox.inbox.claim import NOW_KEY
    from consumers import default_registry
    from orders.tasks import fake_provider, send_confirmation

    app = Celery("plain", broker=os.environ["OUTBOX_BROKER_URL"], set_as_current=False)
    for spec in default_registry():
        def run(body: dict[str, Any], _spec: Any = spec) -> None:
            env = Envelope(message_id=uuid.UUID(body["message_id"]), type=body["type"], payload=body["payload"],
                           headers=dict(body["headers"]), created_at_ms=int(body["created_at_ms"]))
            with sessions()() as s:
                s.info[NOW_KEY] = int(time.time() * 1000)  # the instant the handlers stamp on their rows
                if _spec.prepare is not None:
                    _spec.prepare(s, env)
                _spec.handler(s, env)
                s.commit()

        app.task(name=f"{TASK_PREFIX}{spec.name}")(run)

    def email(task: Any, body: dict[str, Any]) -> None:
        with sessions()() as s:
            send_confirmation(s, fake_provider(s), task_id=str(task.request.id), order_id=body["order_id"])

    app.task(name=f"{TASK_PREFIX}{EMAIL}", bind=True)(email)
    return app


@functools.cache
def _app() -> Celery:
    return build()


def __getattr__(name: str) -> Any:
    """``celery -A bench._plain_worker`` looks up ``app``: built on first access, not at import."""
    if name == "app":
        return _app()
    raise AttributeError(name)


# -- the sending side ---------------------------------------------------------------------------------
def plain_client(broker_url: str, *, confirm_publish: bool) -> Celery:
    """A Celery app with Celery's defaults and this broker; ``confirm_publish``: kombu's transport option
    (each publish waits for RabbitMQ's confirm)."""
    app = Celery("plain-client", broker=broker_url, set_as_current=False)
    if confirm_publish:
        app.conf.broker_transport_options = {"confirm_publish": True}
    return app


def send_order(app: Celery, queues: dict[str, str], consumers: Sequence[str], req: Any, *, now_ms: int) -> None:
    """After the order's commit: one task per consumer and the e-mail task, as ``.delay()`` would send them."""
    from bench._worker import envelope_dict
    from orders.service import order_placed_payload

    body = envelope_dict(message_id=uuid.uuid4(), payload=order_placed_payload(req),
                         entity_key=f"order:{req.order_id}", created_at_ms=now_ms)
    for consumer in consumers:
        app.send_task(f"{TASK_PREFIX}{consumer}", args=[body], queue=queues[consumer])
    app.send_task(f"{TASK_PREFIX}{EMAIL}", args=[{"order_id": req.order_id}], queue=queues[EMAIL])
