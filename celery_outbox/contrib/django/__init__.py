"""Django support: write the outbox and consume idempotently on Django's own connection.

Add ``"celery_outbox.contrib.django"`` to ``INSTALLED_APPS`` and run ``manage.py migrate``: the app's
migrations create the library's tables (``outbox_*``, as ``celery_outbox.schema.define_tables()``
defines them) and, on Postgres, the NOTIFY trigger of the standalone relay.

    with transaction.atomic():
        order = Order.objects.create(...)
        celery_outbox.contrib.django.publish(Event(type="OrderPlaced", payload={...}))

        send_confirmation.delay(order.id)   # a task: an outbox row too (contrib/django/enqueue.py)

    @idempotent_consumer("OrderPlaced", name="fulfilment")     # ordering=, prepare=, using= as needed
    def fulfil(envelope): Shipment.objects.create(...)
    outbox.include(fulfil)    # in an AppConfig.ready(); outbox = DjangoOutbox(app) in proj/celery.py

Dead letters of both stores appear in the Django admin (``celery_outbox.contrib.django.admin``); its
replay and purge go through the project's ``Outbox``: ``DjangoOutbox(app)`` registers itself (``use``),
or set ``OUTBOX_INSTANCE = "proj.celery:outbox"`` (docs/django.md, "Admin").

This module imports no models, so it is safe to import before the app registry is ready.
"""

from __future__ import annotations

from celery_outbox.errors import missing_extra

try:
    import django  # noqa: F401  (every module of this package needs it: one line naming the extra if it is missing)
except ModuleNotFoundError as e:
    raise missing_extra(e.name, needed_by="celery_outbox.contrib.django") from None

from celery_outbox.contrib.django.cancel import cancel
from celery_outbox.contrib.django.conf import connection_url, database_settings, database_url, outbox_settings
from celery_outbox.contrib.django.consumer import DjangoConsumerSpec, idempotent_consumer
from celery_outbox.contrib.django.dead_letters import use
from celery_outbox.contrib.django.enqueue import atomic_writer
from celery_outbox.contrib.django.outbox import DjangoOutbox
from celery_outbox.contrib.django.writer import publish

__all__ = ["DjangoConsumerSpec", "DjangoOutbox", "atomic_writer", "cancel", "connection_url", "database_settings",
           "database_url", "idempotent_consumer", "outbox_settings", "publish", "use"]
