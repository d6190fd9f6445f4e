"""The Celery app, wired the Django way: configuration comes from Django settings (``CELERY_*``).

``settings.py`` derives those ``CELERY_*`` names from ``celeryconfig.celery_config`` so this
project's queues, exchange, JSON-only serialisation and acks_late are exactly the relay's.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop_project.settings")

app = Celery("shop_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Finds shop/tasks.py (the Django consumer "consumers.fulfilment").
app.autodiscover_tasks()


@app.on_after_finalize.connect  # type: ignore[union-attr,untyped-decorator]
def _register_relay(sender: Celery, **_: object) -> None:
    """Run the relay's beat task in this project too (when the relay package provides it)."""
    from django.conf import settings

    try:
        from relay.tasks import register
    except ImportError:  # relay not installed: run ``outbox relay`` beside the worker instead
        return
    register(sender, settings.OUTBOX)
