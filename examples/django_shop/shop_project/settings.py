"""Settings of the example shop: one database (Django's) for the shop, the outbox and the relay."""

from __future__ import annotations

import os
from pathlib import Path

from celery_outbox.contrib.django import database_settings

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "django-insecure-example-shop-only")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",  # /admin/: the dead letters of both stores, with replay and purge
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "celery_outbox.contrib.django",  # the outbox_* tables: manage.py migrate; the dead-letter admin pages
    "shop",
]
# The admin needs sessions, auth and messages; the JSON API views are csrf_exempt.
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
STATIC_URL = "static/"
ROOT_URLCONF = "shop_project.urls"
WSGI_APPLICATION = "shop_project.wsgi.application"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {"default": database_settings(
    os.environ.get("SHOP_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/django_shop"))}

# Read by app.config_from_object("django.conf:settings", namespace="CELERY"); the outbox adds its queues.
CELERY_BROKER_URL = os.environ.get("SHOP_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
OUTBOX_NAMESPACE = "shop"  # exchange and queue prefix: the consumer's queue is shop.fulfilment
# The Outbox the admin's replay and purge go through (imported on first use, not at start-up).
OUTBOX_INSTANCE = "shop_project.celery:outbox"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"celery_outbox": {"handlers": ["console"], "level": "INFO"}},
}
