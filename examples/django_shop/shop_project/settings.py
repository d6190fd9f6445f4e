"""Settings of the example shop. The outbox's own settings come from ``OUTBOX_*`` variables.

One URL (``OUTBOX_DATABASE_URL``) feeds both Django's ``DATABASES`` and the relay, so the order,
its outbox row and the relay's reads are in one database by construction.
"""

from __future__ import annotations

import os
from pathlib import Path

from celeryconfig import Settings, celery_config
from outbox_django import database_settings

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "django-insecure-example-shop-only")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]

INSTALLED_APPS = [
    "outbox_django",
    "shop",
]
# A JSON API without sessions or forms: no CSRF/session middleware in this example.
MIDDLEWARE = ["django.middleware.common.CommonMiddleware"]
ROOT_URLCONF = "shop_project.urls"
WSGI_APPLICATION = "shop_project.wsgi.application"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_env = dict(os.environ)
_env.setdefault("OUTBOX_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/django_shop")
_env.setdefault("OUTBOX_BROKER_URL", "redis://127.0.0.1:6379/0")
_env.setdefault("OUTBOX_NAMESPACE", "shop")
# The shop's OrderPlaced goes to its own Django consumer unless OUTBOX_ROUTES says otherwise.
_env.setdefault("OUTBOX_ROUTES", "OrderPlaced=fulfilment")
_env.setdefault("OUTBOX_HOME", str(BASE_DIR / "var"))
OUTBOX = Settings.from_env(_env)

DATABASES = {"default": database_settings(OUTBOX.effective_database_url)}

# CELERY_BROKER_URL, CELERY_TASK_QUEUES, CELERY_BEAT_SCHEDULE, ... read by
# app.config_from_object("django.conf:settings", namespace="CELERY").
for _key, _value in celery_config(OUTBOX, OUTBOX.broker_url).items():
    globals()[f"CELERY_{_key.upper()}"] = _value

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"outbox_django": {"handlers": ["console"], "level": "INFO"}},
}
