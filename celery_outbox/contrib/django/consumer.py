"""Idempotent consumers on Django's connection, driven by the SHARED delivery core.

``@idempotent_consumer("OrderPlaced", name="fulfilment")`` turns ``handler(envelope)`` into a
``DjangoConsumerSpec``; ``outbox.include(spec)`` makes it a Celery task whose deliveries
``celery_outbox.delivery.deliver`` counts, retries and dead-letters exactly as for SQLAlchemy
consumers (that bookkeeping goes through the SQLAlchemy session the core passes, on the same
database). Only the inbox step differs: the claim (the ``outbox_inbox`` row) and the handler's
effect commit in ONE ``transaction.atomic()`` on Django's connection.

The inbox row is inserted FIRST inside that transaction, so a parallel second delivery of the same
message blocks on the primary key until the first commits, then fails with a unique violation and
returns ``Outcome.DUPLICATE`` without running the handler (its transaction rolls back). If the
handler raises, the inbox row rolls back with the effect and the exception goes to the core.

``ordering=True`` runs the library's ONE per-entity ordering (``celery_outbox.inbox.ordering.apply``: skip
stale versions, park early ones, apply parked successors) on a SQLAlchemy session lent Django's own
connection inside that ``atomic()`` (``lent.py``), so the versions, the parking lot, the inbox row and
the ORM effect still commit together. ``prepare=`` runs an external effect that takes an idempotency key
(an e-mail provider) before that transaction opens, as ``Outbox.consumer(prepare=...)`` does.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db import DatabaseError as DjangoDatabaseError
from sqlalchemy.orm import Session

from celery_outbox import counters
from celery_outbox.clock import Clock
from celery_outbox.consumer import ConsumerSpec, check_batch, one_at_a_time
from celery_outbox.contrib.django.lent import LentSessions
from celery_outbox.counters import DUPLICATES
from celery_outbox.crashpoints import DISARMED
from celery_outbox.errors import ConfigError, DatabaseError, UnknownEventTypeError
from celery_outbox.inbox import ordering as ordering_core
from celery_outbox.inbox.claim import CrashSite, DuplicateDelivery
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.names import check_name
from celery_outbox.policy import RetryPolicy
from celery_outbox.schema import Tables

log = logging.getLogger(__name__)

Effect = Callable[[Envelope], object]
"""The handler: writes with Django's ORM, never commits (the inbox's ``atomic()`` does)."""

BatchEffect = Callable[[list[Envelope]], object]
"""A batch consumer's handler: the effect of many messages at once (``bulk_create``, one upsert)."""

Prepare = Callable[[Envelope], object]
"""An external effect with an idempotency key (derive it from ``envelope.message_id``), run before the
inbox transaction opens; a retry runs it again with the same key."""


class _AlreadyProcessed(Exception):
    """Raised inside the atomic block so that leaving it rolls everything back."""


def already_processed(message_id: Any, consumer: str, *, using: str | None = None) -> bool:
    """The fast path: has ``consumer`` committed ``message_id``? Never the guarantee on its own."""
    from celery_outbox.contrib.django.models import InboxEntry

    return bool(InboxEntry.objects.using(using or DEFAULT_DB_ALIAS)
                .filter(message_id=message_id, consumer=consumer).exists())


def _claim(envelope: Envelope, consumer: str, alias: str, now_ms: int) -> bool:
    """One ``INSERT ... ON CONFLICT DO NOTHING`` (SQLite and Postgres): True when this call inserted the row.

    The same one-statement claim as ``celery_outbox.inbox.claim.claim_if_absent``: no read first, and a
    duplicate is a row count of 0 rather than an aborted transaction. On Postgres a parallel claim of
    the same key waits for the first transaction, then inserts nothing (or inserts, if it rolled back).
    Django's ``bulk_create(ignore_conflicts=True)`` cannot say whether it inserted, hence the SQL.
    """
    from celery_outbox.contrib.django.models import InboxEntry

    connection = connections[alias]
    meta = InboxEntry._meta
    fields = [meta.get_field(name) for name in ("message_id", "consumer", "type", "processed_at_ms")]
    values = [envelope.message_id, consumer, envelope.type, now_ms]
    qn = connection.ops.quote_name
    sql = (f"INSERT INTO {qn(meta.db_table)} ({', '.join(qn(f.column) for f in fields)}) "
           f"VALUES ({', '.join(['%s'] * len(fields))}) ON CONFLICT DO NOTHING")
    params = [f.get_db_prep_value(v, connection, prepared=False) for f, v in zip(fields, values, strict=True)]
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return bool(cursor.rowcount == 1)
    except DjangoDatabaseError as e:
        raise DatabaseError(f"inbox insert for {consumer} {envelope.message_id} failed: {e}") from e


def _claim_many(envelopes: list[Envelope], consumer: str, alias: str, now_ms: int) -> set[uuid.UUID]:
    """``_claim`` for a whole batch: ONE ``INSERT ... VALUES (...), (...) ON CONFLICT DO NOTHING RETURNING``,
    keys sorted (``celery_outbox.inbox.batch.claim_many``); returns the message ids it inserted."""
    from celery_outbox.contrib.django.models import InboxEntry

    if not envelopes:
        return set()
    connection = connections[alias]
    meta = InboxEntry._meta
    fields = [meta.get_field(name) for name in ("message_id", "consumer", "type", "processed_at_ms")]
    qn = connection.ops.quote_name
    rows = sorted(envelopes, key=lambda e: e.message_id)
    one = f"({', '.join(['%s'] * len(fields))})"
    sql = (f"INSERT INTO {qn(meta.db_table)} ({', '.join(qn(f.column) for f in fields)}) "
           f"VALUES {', '.join([one] * len(rows))} ON CONFLICT DO NOTHING RETURNING {qn(fields[0].column)}")
    params = [f.get_db_prep_value(v, connection, prepared=False) for e in rows
              for f, v in zip(fields, (e.message_id, consumer, e.type, now_ms), strict=True)]
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return {uuid.UUID(str(row[0])) for row in cursor.fetchall()}
    except DjangoDatabaseError as e:
        raise DatabaseError(f"inbox insert of a batch of {len(rows)} for {consumer} failed: {e}") from e


@dataclass(frozen=True, kw_only=True)
class DjangoConsumerSpec(ConsumerSpec):
    """A consumer whose inbox claim and effect run in one ``transaction.atomic(using=...)``."""

    effect: Effect
    using: str | None = None
    prepare_effect: Prepare | None = None
    batch_effect: BatchEffect | None = None
    lent: LentSessions = field(default_factory=LentSessions, compare=False, repr=False)

    def handle(self, session: Session, envelope: Envelope, *, tables: Tables, clock: Clock,
               crash_points: CrashSite | None = None, fast_path: bool | None = None,
               park_timeout_ms: int | None = None) -> Outcome:
        """The inbox step for ``deliver``: PROCESSED, DUPLICATE (counted), or with ``ordering`` STALE / PARKED;
        a handler (or ``prepare``) error propagates. ``park_timeout_ms`` (ordered consumers) also dead-letters
        the consumer's parked messages that waited longer, after the commit, as ``inbox.handle`` does."""
        if not self.accepts(envelope.type):
            raise UnknownEventTypeError(
                f"consumer {self.name!r} does not handle event type {envelope.type!r} "
                f"(it handles: {', '.join(sorted(self.events))})"
            )
        alias = self.using or DEFAULT_DB_ALIAS
        crash = crash_points or DISARMED
        if self.prepare_effect is not None:
            # the fast path spares a redelivered or replayed message the external call; the claim below is
            # still the guarantee (a plain delivery needs no read first: the claim reports the duplicate)
            if (self.fast_path if fast_path is None else fast_path) and already_processed(
                    envelope.message_id, self.name, using=alias):
                return self._duplicate(session, envelope, tables=tables)
            session.rollback()  # the external call holds no transaction of ours
            self.prepare_effect(envelope)
        now = clock.now_ms()
        expired = False
        try:
            with transaction.atomic(using=alias):
                if self.ordering:
                    outcome, expired = self._ordered(envelope, alias, tables=tables, now_ms=now,
                                                     park_timeout_ms=park_timeout_ms)
                else:
                    if not _claim(envelope, self.name, alias, now):
                        raise _AlreadyProcessed
                    self.effect(envelope)
                    outcome = Outcome.PROCESSED
                crash.reached("consumer_before_commit")
        except (_AlreadyProcessed, DuplicateDelivery):  # the block rolled back: nothing of this delivery stays
            return self._duplicate(session, envelope, tables=tables)
        crash.reached("consumer_after_commit_before_ack")
        if expired and park_timeout_ms is not None:
            try:
                ordering_core.expire_parked(session, tables=tables, consumer=self.name, now_ms=clock.now_ms(),
                                            timeout_ms=park_timeout_ms)
            except Exception as e:  # bookkeeping only: the effect is committed and the message must be acked
                session.rollback()
                log.warning("could not dead-letter expired parked messages of %s: %s", self.name, e)
        return outcome

    def handle_batch(self, session: Session, envelopes: list[Envelope], *, tables: Tables, clock: Clock,
                     crash_points: CrashSite | None = None) -> list[Outcome]:
        """A batch consumer's inbox step (``celery_outbox.batch_delivery``): the batch's inbox rows claimed in
        one statement and its effect, in ONE ``atomic()``; one outcome per envelope, PROCESSED or DUPLICATE.
        A handler error rolls the block back and propagates. The counts (duplicates, batches) follow in a
        small transaction of the core's session (observability only)."""
        effect = self.batch_step(envelopes, self.batch_effect)
        alias = self.using or DEFAULT_DB_ALIAS
        crash = crash_points or DISARMED
        first: dict[uuid.UUID, Envelope] = {}
        for envelope in envelopes:
            first.setdefault(envelope.message_id, envelope)
        with transaction.atomic(using=alias):
            claimed = _claim_many(list(first.values()), self.name, alias, clock.now_ms())
            fresh = [e for e in first.values() if e.message_id in claimed]
            if fresh:
                effect(fresh)
            crash.reached("consumer_before_commit")
        crash.reached("consumer_after_commit_before_ack")
        outcomes: list[Outcome] = []
        taken: set[uuid.UUID] = set()
        for envelope in envelopes:
            outcomes.append(Outcome.PROCESSED if envelope.message_id in claimed and envelope.message_id not in taken
                            else Outcome.DUPLICATE)
            taken.add(envelope.message_id)
        try:
            counters.stage_increment(session, self.name, DUPLICATES, len(envelopes) - len(fresh), tables=tables)
            counters.stage_increment(session, self.name, counters.BATCHES, 1, tables=tables)
            counters.stage_increment(session, self.name, counters.BATCHED_MESSAGES, len(envelopes), tables=tables)
            session.commit()
        except Exception as e:  # the batch is committed and must be acked: its counts are not worth a redelivery
            session.rollback()
            log.warning("could not count a batch of %s: %s", self.name, e)
        return outcomes

    def _ordered(self, envelope: Envelope, alias: str, *, tables: Tables, now_ms: int,
                 park_timeout_ms: int | None) -> tuple[Outcome, bool]:
        """The library's per-entity ordering inside the open ``atomic()``; DUPLICATE raises to roll it back."""
        def handler(_session: Session, env: Envelope) -> None:
            self.effect(env)  # the Django ORM, on the connection the lent session runs on

        with self.lent.session(alias) as lent:
            outcome, expired = ordering_core.apply(
                lent, envelope, tables=tables, consumer=self.name, handler=handler,
                now_ms=now_ms, expire_cutoff_ms=None if park_timeout_ms is None else now_ms - park_timeout_ms)
        if outcome is Outcome.DUPLICATE:
            raise _AlreadyProcessed
        return outcome, expired

    def _duplicate(self, session: Session, envelope: Envelope, *, tables: Tables) -> Outcome:
        log.info("%s: %s %s is a duplicate (inbox key)", self.name, envelope.type, envelope.message_id)
        counters.increment(session, self.name, DUPLICATES, tables=tables)
        return Outcome.DUPLICATE


def idempotent_consumer(event: str | Iterable[str], *, name: str, using: str | None = None, fast_path: bool = True,
                        ordering: bool = False, prepare: Prepare | None = None, max_retries: int | None = None,
                        retry_backoff: bool | float = True, retry_backoff_max: float | None = None,
                        retry_jitter: bool = False, batch_size: int | None = None,
                        batch_wait_ms: int | None = None) -> Callable[[Effect | BatchEffect], DjangoConsumerSpec]:
    """Declare ``handler(envelope)`` as consumer ``name`` of ``event`` on Django's database ``using``.

    ``batch_size=N``: a batch consumer, ``handler(envelopes)`` given up to N messages that arrived within
    ``batch_wait_ms``; their inbox rows and its ORM writes commit in ONE ``atomic()`` (docs/tasks.md).

    Returns a spec; ``outbox.include(spec)`` defines its Celery task. ``ordering``, ``prepare``, ``fast_path``
    and the retry options mean what they mean on ``Outbox.consumer``; ``prepare(envelope)`` takes no session.
    """
    check_name(name)
    events = frozenset([event] if isinstance(event, str) else event)
    if not events or not all(isinstance(e, str) and e.strip() for e in events):
        raise ConfigError(f"consumer {name!r} needs at least one non-empty event type")
    if ordering and prepare is not None:
        raise ConfigError(f"consumer {name!r}: per-entity ordering cannot be combined with a prepare step")
    if prepare is not None and not callable(prepare):
        raise ConfigError(f"consumer {name!r}: prepare must be a function of the envelope")
    policy = RetryPolicy(max_retries=max_retries, retry_backoff=retry_backoff, retry_backoff_max=retry_backoff_max,
                         retry_jitter=retry_jitter)

    size, wait = check_batch(name, batch_size=batch_size, batch_wait_ms=batch_wait_ms, ordering=ordering,
                             prepare=prepare)

    def decorate(given: Effect | BatchEffect) -> DjangoConsumerSpec:
        if size is not None:
            batch = cast(BatchEffect, given)

            def batch_handler(_session: Session, envelopes: list[Envelope]) -> None:
                batch(envelopes)

            return DjangoConsumerSpec(name=name, events=events, handler=one_at_a_time(batch_handler),
                                      fast_path=fast_path, policy=policy, effect=lambda e: batch([e]), using=using,
                                      batch_size=size, batch_wait_ms=wait, batch_handler=batch_handler,
                                      batch_effect=batch)
        effect = cast(Effect, given)

        def handler(_session: Session, envelope: Envelope) -> None:
            effect(envelope)

        return DjangoConsumerSpec(name=name, events=events, handler=handler, fast_path=fast_path, policy=policy,
                                  ordering=ordering, effect=effect, using=using, prepare_effect=prepare)

    return decorate
