"""The Orders HTTP app wired to this deployment's ``Outbox`` (``relay.wsgi`` serves it; tests build their own).

The Orders service (orders/web.py) is handed the outbox it writes to; building that outbox (settings,
Celery app, consumers, the e-mail task, the embedded broker) is this folder's job (relay/factory.py).
"""

from __future__ import annotations

from flask import Flask
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Clock, SystemClock
from celeryconfig import Settings
from orders.web import create_app as orders_app
from relay.factory import create_outbox


def create_app(*, settings: Settings | None = None, session_factory: sessionmaker[Session] | None = None,
               clock: Clock | None = None) -> Flask:
    """App factory: settings from the environment unless given; tests pass their own session factory and clock."""
    outbox = create_outbox(settings or Settings.from_env(), session_factory=session_factory,
                           clock=clock or SystemClock())
    return orders_app(outbox=outbox)
