"""The Celery app of the ordering run's workers (chaos/ordering_run.py): the deployment's configuration
with ONE consumer, ``consumers.search.search_in_order``, the search effect as a per-entity ordered consumer.

The deployment itself registers the batch search consumer (``consumers/search.py``), which keeps the
newest document by its version guard and has no per-entity ordering to observe; the ordering run measures
the ordering itself (versions applied in order, early ones parked and released), so its workers run this.

    celery -A chaos.ordered_search_app worker -Q <namespace>.search
"""

from __future__ import annotations

from celery import Celery

from celery_outbox import Outbox, exit_on_config_error
from celeryconfig import Settings, celery_config
from consumers.search import search_in_order

with exit_on_config_error():
    settings = Settings.from_env()
    app = Celery("outbox", set_as_current=False)
    app.conf.update(celery_config(settings, settings.broker_url))
    outbox = Outbox(app, settings=settings.replace(database_url=settings.effective_database_url))
    outbox.include(search_in_order)
    outbox.check()

__all__ = ["app", "outbox"]
