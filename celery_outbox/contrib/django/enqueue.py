"""Transactional enqueue on Django: inside ``transaction.atomic()``, ``task.delay()`` writes an outbox row.

``DjangoOutbox`` hands ``django_outbox_writer`` to its ``Outbox`` (``ambient=``; a plain ``Outbox`` in a
Django project may be given ``atomic_writer``): when that outbox's Celery app sends a task and no SQLAlchemy session is bound
(``outbox.transaction``), the capture (``celery_outbox.celery.enqueue``) asks this provider; if the
Django connection the outbox models write to is inside an ``atomic()`` block (ATOMIC_REQUESTS
included), the task message becomes an ``OutboxMessage`` row on that connection, committed or rolled
back with the view's data. The view's body keeps its ``.delay()``:

    with transaction.atomic():
        order = Order.objects.create(...)
        send_confirmation.delay(order.id)     # an outbox row; the relay sends it after the commit

Outside ``atomic()`` (autocommit: a script, a management command, a shell, an ``on_commit`` callback),
``OUTBOX_ENQUEUE_OUTSIDE_TRANSACTION`` decides: ``own_transaction`` writes the row in an ``atomic()`` of
its own (``OwnAtomicWriter``: durable, not atomic with earlier writes), ``raise`` and ``publish`` are
left to the capture (refused, or sent directly). Django's ``TestCase`` wraps every test in ``atomic()``: a task sent
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

from celery_outbox import dedup
from celery_outbox.errors import ConfigError, DatabaseError, ValidationError

OWN_TRANSACTION = "own_transaction"


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

    def write_unique(self, values: dict[str, Any], key: str, on_conflict: dedup.OnConflict) -> dedup.Deduplicated:
        """The SQLAlchemy path's algorithm (celery_outbox/dedup.py) in the ORM: delete the key's pending row
        (replace), insert ignoring a conflict, look again; in a savepoint (inside the caller's ``atomic()``)
        or a transaction of its own (outside one)."""
        from celery_outbox.contrib.django.models import OutboxMessage

        objects = OutboxMessage.objects.using(self.alias)
        holder = objects.filter(dedup_key=key, published_at_ms__isnull=True, dead_lettered_at_ms__isnull=True)
        replaced: uuid.UUID | None = None
        try:
            with transaction.atomic(using=self.alias):
                for _ in range(dedup.ATTEMPTS):
                    if on_conflict == dedup.REPLACE:
                        gone = list(holder.values_list("message_id", flat=True)[:1])
                        if gone and holder.filter(message_id=gone[0]).delete()[0]:
                            replaced = gone[0]
                    objects.bulk_create([OutboxMessage(**values, dedup_key=key)], ignore_conflicts=True)
                    if objects.filter(message_id=values["message_id"]).exists():
                        return dedup.Deduplicated(key=key, outcome="replaced" if replaced else "written",
                                                  message_id=values["message_id"], replaced=replaced)
                    if on_conflict == dedup.KEEP:
                        held = holder.values_list("message_id", flat=True).first()
                        if held is not None:
                            return dedup.Deduplicated(key=key, outcome="kept", message_id=held)
        except DjangoDatabaseError as e:
            raise DatabaseError(f"writing task {values['type']!r} with dedup key {key[:80]!r} failed: "
                                f"{e.__class__.__name__}: {e}") from e
        raise ConfigError(f"task {values['type']!r}: dedup key {key[:80]!r} kept conflicting after {dedup.ATTEMPTS} "
                          "writes (another process writing it in a loop?); nothing was written")

    def holds(self, message_id: uuid.UUID) -> bool:
        """True when an outbox row on this connection (this ``atomic()`` block's included) has ``message_id``."""
        from celery_outbox.contrib.django.models import OutboxMessage

        try:
            return bool(OutboxMessage.objects.using(self.alias).filter(message_id=message_id).exists())
        except DjangoDatabaseError as e:
            raise DatabaseError(f"checking task id {message_id} against the outbox failed: "
                                f"{e.__class__.__name__}: {e}") from e


class OwnAtomicWriter(DjangoWriter):
    """No ``atomic()`` is open on the alias (a script, a management command, a shell, an ``on_commit``
    callback): the row commits at once in an ``atomic()`` of its own. Durable from then on (the relay sends
    it after a crash or a broker outage), never atomic with anything written before (docs/django.md)."""

    def write(self, values: dict[str, Any]) -> None:
        from django.db import IntegrityError

        try:
            with transaction.atomic(using=self.alias):
                super().write(values)
        except DatabaseError as e:
            if isinstance(e.__cause__, IntegrityError):  # a chosen task id another process wrote meanwhile
                raise ValidationError(f"task {values['type']!r} has task_id {str(values['message_id'])!r}, which an "
                                      "outbox row already holds (a task id is the message id: use a new one); "
                                      "nothing was written") from None
            raise


def atomic_writer(outbox: Any, *, own_transaction: bool = False) -> DjangoWriter | None:
    """The Django writer for ``outbox``'s task rows, or None (then ``enqueue_outside_transaction`` decides).

    Inside ``atomic()`` on the outbox's alias (``DjangoOutbox(using=...)``, else the router's alias of
    the outbox models): a row of that transaction. Outside it, when ``own_transaction`` is asked (a
    ``DjangoOutbox``'s writer) and ``enqueue_outside_transaction`` is ``own_transaction``, a row committed in
    an ``atomic()`` of its own, except where the library sends directly whatever the mode (inside a running
    worker task, in ``celery beat``); a plain ``Outbox`` commits such a row through its own engine.
    """
    from django.apps import apps
    from django.conf import settings

    if not settings.configured or not apps.ready or not apps.is_installed("celery_outbox.contrib.django"):
        return None
    from celery_outbox.contrib.django.models import OutboxMessage

    alias = getattr(outbox, "using", None) or router.db_for_write(OutboxMessage)
    connection = transaction.get_connection(alias)
    if connection.in_atomic_block:
        return DjangoWriter(connection.alias)
    # A plain ``Outbox`` (its own engine) in a Django process commits its own row through that engine.
    if not own_transaction or outbox.settings.enqueue_outside_transaction != OWN_TRANSACTION \
            or outbox._enqueue_interceptor.in_beat or outbox.app.current_worker_task is not None:
        return None
    return OwnAtomicWriter(connection.alias)


def django_outbox_writer(outbox: Any) -> DjangoWriter | None:
    """The writer ``DjangoOutbox`` hands its ``Outbox``: ``atomic_writer``, which outside ``atomic()`` may
    also commit a row in an ``atomic()`` of its own (a plain ``Outbox`` has its own engine for that)."""
    return atomic_writer(outbox, own_transaction=True)
