"""The Celery application: ``celery -A outbox.celery_app worker|beat``.

Built from ``Settings.from_env()`` (celeryconfig.py); the relay and consumer tasks are registered by
functions of their packages, so ``relay/`` and ``consumers/`` hold no module-level Celery state.
"""

from __future__ import annotations

from celery import Celery

from celeryconfig import Settings, celery_config
from outbox.embedded import resolve_broker_url


def create_celery_app(settings: Settings | None = None, *, broker_url: str | None = None) -> Celery:
    settings = settings or Settings.from_env()
    url = broker_url or resolve_broker_url(settings.broker_url, home=settings.home)
    app = Celery("outbox", set_as_current=False)
    app.conf.update(celery_config(settings, url))
    app.conf["outbox_settings"] = settings
    # Imported here, not at module top: relay/consumers/ops import this package's modules.
    from consumers.tasks import register as register_consumers
    from ops.tasks import register as register_ops
    from relay.tasks import register as register_relay

    register_relay(app, settings)  # relay.tasks.drain_outbox (beat)
    register_consumers(app, settings)  # consumers.<name>, one queue each
    register_ops(app, settings)  # ops.tasks.prune (beat) and the worker's /metrics
    return app


app = create_celery_app()
