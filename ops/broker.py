"""A Celery app for sending replays from the CLI or the web app.

Built here rather than imported from ``outbox.celery_app``, whose module-level ``app`` reads the
environment (and may start the embedded broker) at import time.
"""

from __future__ import annotations

from celery import Celery

from celeryconfig import Settings, celery_config
from ops.dead_letters import Sender
from outbox.embedded import resolve_broker_url


def sending_app(settings: Settings, *, broker_url: str | None = None) -> Celery:
    url = broker_url or resolve_broker_url(settings.broker_url, home=settings.home)
    app = Celery("outbox-ops", set_as_current=False)
    app.conf.update(celery_config(settings, url))
    app.conf["outbox_settings"] = settings
    return app


def replay_sender(settings: Settings) -> Sender:
    """The consumers' own sender: a replay goes to that consumer's queue as an ordinary task message."""
    from consumers.dead_letters import celery_sender

    return celery_sender(sending_app(settings), settings)
