"""The Celery app, wired the Django way, and the project's ``Outbox`` on Django's own database.

``database_url()`` turns ``DATABASES["default"]`` into the SQLAlchemy URL the relay and the
consumers' bookkeeping use, so they cannot drift onto another database. Consumers are added in
``ShopConfig.ready()`` (they import models).
"""

from __future__ import annotations

import os

from celery import Celery
from django.conf import settings

from celery_outbox import Outbox, Settings
from celery_outbox.contrib.django import atomic_writer, database_url

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop_project.settings")

app = Celery("shop_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
# ambient=: a task sent inside Django's atomic() is a row of that transaction (docs/django.md).
outbox = Outbox(app, settings=Settings(database_url=database_url(), namespace=settings.OUTBOX_NAMESPACE),
                ambient=atomic_writer)
