"""Django support: write the outbox and consume idempotently on Django's own connection.

Add ``"outbox_django"`` to ``INSTALLED_APPS``. The tables come from the one set of Alembic
migrations (``outbox db upgrade``); the models here are unmanaged views of them, so Django never
migrates them and the relay (SQLAlchemy) and Django read and write the same rows.

    with transaction.atomic():
        order = Order.objects.create(...)
        outbox_django.add(Event(type="OrderPlaced", payload={...}))

This module imports no models, so it is safe to import before the app registry is ready.
"""

from __future__ import annotations

from outbox_django.conf import database_settings
from outbox_django.consumer import idempotent_consumer
from outbox_django.writer import add

__all__ = ["add", "database_settings", "idempotent_consumer"]
