"""The Django outbox writer: the event row commits or rolls back with the caller's ``transaction.atomic()``.

Validation and the row's contents come from ``celery_outbox.writer.outbox_values`` (the same function the
SQLAlchemy writer uses), so both write byte-for-byte the same message format the relay reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError as DjangoDatabaseError
from django.db import transaction

from celery_outbox.clock import Clock
from celery_outbox.errors import DatabaseError, TransactionRequiredError
from celery_outbox.writer import Event, outbox_values

if TYPE_CHECKING:
    from celery_outbox.contrib.django.models import OutboxMessage


def publish(event: Event, *, using: str | None = None, clock: Clock | None = None,
            max_message_bytes: int | None = None, known_types: Iterable[str] | None = None) -> OutboxMessage:
    """Write ``event`` as a pending outbox row on Django's connection ``using`` (default: the project's
    ``DjangoOutbox(using=...)``, else the router's alias for the outbox models: ``conf.outbox_alias``).

    Must run inside ``transaction.atomic()`` (or with ATOMIC_REQUESTS, or autocommit switched off):
    in autocommit the row would commit on its own, and a later failure of the caller's work would
    leave an event published for something that never happened. Refuses with
    ``TransactionRequiredError`` before writing anything; an invalid event raises the same
    ``ValidationError``/``SerializationError``/``MessageTooLargeError`` as the SQLAlchemy writer.
    Pass ``known_types=outbox.routes()`` to refuse an event no consumer is routed for.
    """
    from celery_outbox.contrib.django.conf import outbox_alias
    from celery_outbox.contrib.django.models import OutboxMessage

    connection = transaction.get_connection(using or outbox_alias())
    if connection.get_autocommit():
        raise TransactionRequiredError(
            "celery_outbox.contrib.django.publish() must be called inside transaction.atomic() "
            f"(database {connection.alias!r} is in autocommit): the event must commit or roll back "
            "together with the data it describes"
        )
    values: dict[str, Any] = outbox_values(event, clock=clock, max_message_bytes=max_message_bytes,
                                           known_types=known_types)
    try:
        row: OutboxMessage = OutboxMessage.objects.using(connection.alias).create(**values)
    except DjangoDatabaseError as e:
        raise DatabaseError(
            f"writing outbox row {event.message_id} ({event.type}) failed: {e.__class__.__name__}: {e}"
        ) from e
    return row
