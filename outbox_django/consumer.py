"""The idempotent consumer for Django: the handler's effect and the inbox row commit in ONE transaction.

The inbox's composite primary key (message_id, consumer) is the guarantee; the "already seen?"
query is only a fast path. The inbox row is inserted FIRST inside the transaction, so a parallel
second delivery of the same message blocks on the key until the first commits, then fails with a
unique violation and returns ``Outcome.DUPLICATE`` without running the handler (its transaction,
and anything in it, is rolled back). If the first delivery fails instead, its inbox row rolls
back with its effect and the message is processed by the next delivery.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.db import DEFAULT_DB_ALIAS, IntegrityError, connections, transaction
from django.db import DatabaseError as DjangoDatabaseError

from consumers.outcome import Outcome
from outbox.clock import Clock, SystemClock
from outbox.errors import DatabaseError, OutboxError, ValidationError
from outbox.messages import Envelope, encode_json

if TYPE_CHECKING:
    from outbox_django.models import ConsumerDeadLetter, InboxEntry

log = logging.getLogger(__name__)

MAX_CONSUMER_NAME = 64  # inbox.consumer is VARCHAR(64)
DUPLICATES = "duplicates"  # the consumer_counters name `outbox stats` reports as duplicates absorbed

Handler = Callable[[Envelope], object]
Consume = Callable[[Any], Outcome]


class _AlreadyProcessed(Exception):
    """Raised inside the atomic block so that leaving it rolls everything back."""


def is_unique_violation(error: IntegrityError) -> bool:
    """True for a primary-key/unique violation (psycopg2, psycopg 3 or SQLite), not FK/NOT NULL."""
    cause = error.__cause__
    code = getattr(cause, "pgcode", None) or getattr(cause, "sqlstate", None)
    if code is not None:
        return bool(code == "23505")
    text = str(cause if cause is not None else error)
    return "UNIQUE constraint failed" in text


def already_processed(message_id: Any, consumer: str, *, using: str | None = None) -> bool:
    """The fast path: has ``consumer`` committed ``message_id``? Never the guarantee on its own."""
    from outbox_django.models import InboxEntry

    return bool(
        InboxEntry.objects.using(using or DEFAULT_DB_ALIAS)
        .filter(message_id=message_id, consumer=consumer)
        .exists()
    )


def increment_counter(consumer: str, name: str, by: int = 1, *, using: str | None = None) -> None:
    """``consumer_counters(consumer, name) += by`` (an upsert). Observability only: logged, never raised."""
    from outbox_django.models import ConsumerCounter

    alias = using or DEFAULT_DB_ALIAS
    table = connections[alias].ops.quote_name(ConsumerCounter._meta.db_table)
    try:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {table} (consumer, name, value) VALUES (%s, %s, %s) "
                f"ON CONFLICT (consumer, name) DO UPDATE SET value = {table}.value + EXCLUDED.value",
                [consumer, name, by],
            )
    except DjangoDatabaseError as e:
        log.warning("could not count %s for %s: %s", name, consumer, e)


def _claim(envelope: Envelope, consumer: str, alias: str, now_ms: int) -> InboxEntry:
    from outbox_django.models import InboxEntry

    try:
        entry: InboxEntry = InboxEntry.objects.using(alias).create(
            message_id=envelope.message_id, consumer=consumer, type=envelope.type, processed_at_ms=now_ms,
        )
    except IntegrityError as e:
        if is_unique_violation(e):
            raise _AlreadyProcessed from e
        raise DatabaseError(f"inbox insert for {consumer} {envelope.message_id} failed: {e}") from e
    except DjangoDatabaseError as e:
        raise DatabaseError(f"inbox insert for {consumer} {envelope.message_id} failed: {e}") from e
    return entry


def idempotent_consumer(consumer: str, *, using: str | None = None, fast_path: bool = True,
                        clock: Clock | None = None) -> Callable[[Handler], Consume]:
    """Decorate ``handler(envelope)`` so each message has its effect once for ``consumer``.

    The decorated function takes the delivered body (envelope dict, JSON text or ``Envelope``) and
    returns ``Outcome.PROCESSED`` or ``Outcome.DUPLICATE``. A malformed body raises
    ``MalformedMessageError`` (poison: do not retry); an exception from the handler propagates with
    nothing committed (neither effect nor inbox row), so the message is redelivered. Called inside
    an outer ``transaction.atomic()``, the work is a savepoint and commits with the outer block.
    """
    if not isinstance(consumer, str) or not consumer or len(consumer) > MAX_CONSUMER_NAME:
        raise ValidationError(f"consumer name must be 1-{MAX_CONSUMER_NAME} characters, got {consumer!r}")
    the_clock: Clock = clock or SystemClock()

    def decorate(handler: Handler) -> Consume:
        @functools.wraps(handler)
        def consume(message: Any) -> Outcome:
            envelope = message if isinstance(message, Envelope) else Envelope.from_dict(message)
            alias = using or DEFAULT_DB_ALIAS
            if fast_path and already_processed(envelope.message_id, consumer, using=alias):
                log.info("%s: %s %s already processed (fast path)", consumer, envelope.type, envelope.message_id)
                increment_counter(consumer, DUPLICATES, using=alias)
                return Outcome.DUPLICATE
            try:
                with transaction.atomic(using=alias):
                    _claim(envelope, consumer, alias, the_clock.now_ms())
                    handler(envelope)
            except _AlreadyProcessed:
                log.info("%s: %s %s is a duplicate (inbox key), rolled back", consumer, envelope.type,
                         envelope.message_id)
                increment_counter(consumer, DUPLICATES, using=alias)
                return Outcome.DUPLICATE
            return Outcome.PROCESSED

        return consume

    return decorate


def dead_letter(consumer: str, message: Any, error: BaseException | str, *, delivery_count: int,
                using: str | None = None, clock: Clock | None = None) -> ConsumerDeadLetter:
    """Store a message ``consumer`` gave up on (malformed, or failed its last delivery) for a person.

    Runs in its own transaction (autocommit or a savepoint) so it survives the failed handler's
    rollback; the raw body is kept even when it is not a valid envelope.
    """
    from outbox_django.models import ConsumerDeadLetter

    if isinstance(message, Envelope):
        message = message.to_dict()
    if isinstance(message, bytes):
        message = message.decode("utf-8", errors="replace")
    if isinstance(message, str):
        body = message
    else:
        try:
            body = encode_json(message, what="dead letter")
        except OutboxError:
            body = repr(message)
    mapping = message if isinstance(message, dict) else {}
    headers = mapping.get("headers")
    now = (clock or SystemClock()).now_ms()
    with transaction.atomic(using=using or DEFAULT_DB_ALIAS):
        letter: ConsumerDeadLetter = ConsumerDeadLetter.objects.using(using or DEFAULT_DB_ALIAS).create(
            consumer=consumer,
            message_id=str(mapping.get("message_id", ""))[:64],
            type=str(mapping["type"])[:200] if isinstance(mapping.get("type"), str) else None,
            body=body,
            headers=dict(headers) if isinstance(headers, dict) else {},
            delivery_count=delivery_count,
            last_error=str(error) if isinstance(error, str) else f"{type(error).__name__}: {error}",
            first_failed_at_ms=now,
            last_failed_at_ms=now,
        )
    return letter
