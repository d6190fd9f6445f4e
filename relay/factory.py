"""Build this deployment's ``Outbox``: its Celery app, its settings, its four consumers."""

from __future__ import annotations

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

import consumers
from celery_outbox import Clock, Outbox
from celeryconfig import Settings, celery_config
from devtools.embedded import resolve_broker_url


def create_outbox(settings: Settings | None = None, *, broker_url: str | None = None,
                  session_factory: sessionmaker[Session] | None = None, clock: Clock | None = None) -> Outbox:
    settings = settings or Settings.from_env()
    url = broker_url or resolve_broker_url(settings.broker_url, home=settings.home)
    app = Celery("outbox", set_as_current=False)
    app.conf.update(celery_config(settings, url))
    settings = settings.replace(database_url=settings.effective_database_url, broker_url=url)
    outbox = Outbox(app, settings=settings, session_factory=session_factory, clock=clock)
    consumers.register(outbox)
    return outbox


def create_celery_app(settings: Settings | None = None, *, broker_url: str | None = None) -> Celery:
    return create_outbox(settings, broker_url=broker_url).app
