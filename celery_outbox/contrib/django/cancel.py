"""Cancel a task still waiting in the outbox, inside Django's ``transaction.atomic()`` (docs/scheduled.md).

The twin of ``Outbox.cancel`` (``celery_outbox.cancel``): the pending row is deleted on the connection the
outbox models write to, committed or rolled back with the view's data. On Postgres the row is locked
first (``select_for_update``), so a cancel racing the relay waits for its batch and then sees whether the
row was published.
"""

from __future__ import annotations

import uuid

from django.db import DatabaseError as DjangoDatabaseError
from django.db import transaction
from django.db.models import F

from celery_outbox import counters
from celery_outbox.cancel import CANCELLED, Cancelled, not_cancelled, task_uuid
from celery_outbox.contrib.django.conf import outbox_alias
from celery_outbox.errors import DatabaseError, TransactionRequiredError


def cancel(task_id: str | uuid.UUID, *, using: str | None = None) -> Cancelled:
    """Delete the pending outbox row of ``task_id`` (the caller's ``atomic()`` commits it). Raises
    ``AlreadyPublishedError`` when the relay published it, ``NotFoundError`` when no row has the id,
    ``TransactionRequiredError`` outside ``atomic()``."""
    from celery_outbox.contrib.django.models import ConsumerCounter, OutboxMessage

    message_id = task_uuid(task_id)
    alias = using or outbox_alias()  # the project's DjangoOutbox's database, else the router's
    connection = transaction.get_connection(alias)
    if connection.get_autocommit():
        raise TransactionRequiredError(
            f"celery_outbox.contrib.django.cancel() must be called inside transaction.atomic() (database {alias!r} "
            "is in autocommit): the cancel must commit or roll back with the work that decided it")
    try:
        found = list(OutboxMessage.objects.using(alias).select_for_update()
                     .filter(message_id=message_id).values_list("published_at_ms", "type", "next_attempt_at_ms"))
        if not found or found[0][0] is not None:
            raise not_cancelled(message_id, found[0][0] if found else None)
        OutboxMessage.objects.using(alias).filter(message_id=message_id, published_at_ms__isnull=True).delete()
        if connection.vendor == "postgresql":  # striped, as the SQLAlchemy side counts (celery_outbox/counters.py)
            table = connection.ops.quote_name(ConsumerCounter._meta.db_table)
            with connection.cursor() as cursor:
                cursor.execute(f"WITH {counters.striped_increment_ctes(table, amount='1', param='%({})s'.format)} "
                               "SELECT 1", {"scope": counters.RELAY, "name": CANCELLED,
                                            "stripe": counters.stripe_prefix(CANCELLED)})
        else:
            ConsumerCounter.objects.using(alias).get_or_create(consumer=counters.RELAY, name=CANCELLED,
                                                              defaults={"value": 0})
            ConsumerCounter.objects.using(alias).filter(consumer=counters.RELAY, name=CANCELLED).update(
                value=F("value") + 1)
    except DjangoDatabaseError as e:
        raise DatabaseError(f"cancelling outbox row {message_id} failed: {e.__class__.__name__}: {e}") from e
    return Cancelled(message_id=message_id, type=str(found[0][1]), due_at_ms=int(found[0][2]))
