"""Transactional enqueue on Django: inside ``transaction.atomic()``, ``task.delay()`` writes an outbox row.

Registered on import of ``celery_outbox.contrib.django`` (which Django imports for ``INSTALLED_APPS``):
when an ``Outbox``'s Celery app sends a task and no SQLAlchemy session is bound
(``outbox.transaction``), the capture (``celery_outbox.celery.enqueue``) asks this provider; if the
Django connection the outbox models write to is inside an ``atomic()`` block (ATOMIC_REQUESTS
included), the task message becomes an ``OutboxMessage`` row on that connection, committed or rolled
back with the view's data. The view's body keeps its ``.delay()``:

    with transaction.atomic():
        order = Order.objects.create(...)
        send_confirmation.delay(order.id)     # an outbox row; the relay sends it after the commit

Outside ``atomic()`` (autocommit) nothing is captured here, and ``OUTBOX_ENQUEUE_OUTSIDE_TRANSACTION``
decides (raise, or send directly). Django's ``TestCase`` wraps every test in ``atomic()``: a task sent
in such a test is an uncommitted row the test's rollback removes, invisible to the relay (another
connection); ``celery_outbox.contrib.django.testing`` shows and runs it inside the test.

The refusals are the SQLAlchemy path's (the capture is shared): everything
``celery_outbox.task_rules`` refuses, and a chosen task id an outbox row already holds, each a
``ValidationError`` raised inside the ``atomic()`` block before anything is written.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.db import DatabaseError as DjangoDatabaseError
from django.db import router, transaction

from celery_outbox.celery import enqueue
from celery_outbox.errors import DatabaseError


class DjangoWriter:
    """Writes the captured task row with the Django ORM on ``alias`` (inside the caller's ``atomic()``)."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def write(self, values: dict[str, Any]) -> None:
        from celery_outbox.contrib.django.models import OutboxMessage

        try:
            OutboxMessage.objects.using(self.alias).create(**values)
        except DjangoDatabaseError as e:
            raise DatabaseError(f"writing the outbox row of task {values['type']!r} ({values['message_id']}) failed: "
                                f"{e.__class__.__name__}: {e}") from e

    def holds(self, message_id: uuid.UUID) -> bool:
        """True when an outbox row on this connection (this ``atomic()`` block's included) has ``message_id``."""
        from celery_outbox.contrib.django.models import OutboxMessage

        try:
            return bool(OutboxMessage.objects.using(self.alias).filter(message_id=message_id).exists())
        except DjangoDatabaseError as e:
            raise DatabaseError(f"checking task id {message_id} against the outbox failed: "
                                f"{e.__class__.__name__}: {e}") from e


def atomic_writer(outbox: Any) -> DjangoWriter | None:
    """A writer when Django is set up and its outbox connection is inside ``atomic()``, else None."""
    from django.apps import apps
    from django.conf import settings

    if not settings.configured or not apps.ready or not apps.is_installed("celery_outbox.contrib.django"):
        return None
    from celery_outbox.contrib.django.models import OutboxMessage

    alias = router.db_for_write(OutboxMessage)
    connection = transaction.get_connection(alias)
    if not connection.in_atomic_block:
        return None
    return DjangoWriter(connection.alias)


enqueue.register_ambient(atomic_writer)
