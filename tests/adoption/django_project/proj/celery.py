# `celery -A proj worker` and `outbox -A proj.celery relay` find the Celery app and the outbox here.
import os

import django
from celery import Celery
from django.conf import settings

from celery_outbox import Outbox, Settings
from celery_outbox.contrib.django import database_url

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
django.setup()
from orders.consumers import notify  # noqa: E402  (imports models: after django.setup())

app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
outbox = Outbox(app, settings=Settings(database_url=database_url(), namespace=settings.OUTBOX_NAMESPACE))
outbox.include(notify)
