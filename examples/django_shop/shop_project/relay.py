"""The outbox with Django set up and the consumers included: ``outbox relay -A shop_project.relay``."""

from __future__ import annotations

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop_project.settings")
django.setup()

from shop_project.celery import outbox  # noqa: E402  (after django.setup(): ready() includes the consumers)

__all__ = ["outbox"]
