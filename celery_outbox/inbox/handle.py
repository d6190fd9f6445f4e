"""The inbox: an effect and its ``(message_id, consumer)`` row commit together, or not at all.

``handle()`` is the whole idempotent-consumer algorithm and needs no Celery. On the happy path it is
ONE transaction and one commit:

1. claim the inbox key: ``INSERT ... ON CONFLICT DO NOTHING`` (``claim.claim_if_absent``), first in
   the transaction, so a parallel duplicate waits on the row lock and then finds the key instead of
   running the effect; a row count of 0 is the duplicate, detected without a prior read and without
   an aborted transaction (the duplicate counter is committed in that same transaction);
2. run the handler's effect, flush, commit.

With a ``prepare`` step (an effect outside the database that takes an idempotency key: an e-mail
provider) the external call runs BEFORE that transaction, so no database lock is held during the
slow call; a retry repeats it with the same key and the provider answers it once. There, and only
there, ``fast_path`` keeps a read of the inbox key before the call: it is what spares a redelivered
or replayed message the external call (a provider's idempotency keys may expire; a call costs time
and money). Skipping it is still correct: the claim after the call reports the duplicate.

With ``ordering`` the per-entity bookkeeping (``ordering.apply``) runs inside the same transaction;
parked messages past ``park_timeout_ms`` are looked for in it too (one read), and only when there
are some does a second transaction dead-letter them.

The composite primary key is the guarantee. Writing the inbox row in a transaction of its own before
the effect would lose the effect on a crash between the two (see
tests/unit/test_consumer_inbox.py::test_mirror_bug_loses_the_effect); the design forbids it.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from celery_outbox import counters
from celery_outbox.clock import Clock
from celery_outbox.crashpoints import DISARMED
from celery_outbox.errors import ConfigError
from celery_outbox.inbox import ordering as ordering_module
from celery_outbox.inbox.claim import (
    NOW_KEY,
    CrashSite,
    DuplicateDelivery,
    Handler,
    Prepare,
    already_seen,
    claim_if_absent,
    commit_effect,
    undone_on_error,
)
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables

log = logging.getLogger(__name__)

__all__ = ["handle"]


def _duplicate(session: Session, consumer: str, *, tables: Tables) -> Outcome:
    """Nothing of this delivery was written: count the duplicate in the open transaction and commit it."""
    counters.increment(session, consumer, counters.DUPLICATES, tables=tables)
    return Outcome.DUPLICATE


def handle(session: Session, envelope: Envelope, *, tables: Tables, consumer: str, handler: Handler, clock: Clock,
           fast_path: bool = True, ordering: bool = False, crash_points: CrashSite | None = None,
           prepare: Prepare | None = None, park_timeout_ms: int | None = None) -> Outcome:
    """Handle one delivery of ``envelope`` for ``consumer``; commits ``session``.

    Returns PROCESSED, DUPLICATE, or (with ``ordering``) STALE / PARKED. A handler exception rolls
    everything back (no effect, no inbox row) and propagates: the caller redelivers. ``fast_path``
    only matters with ``prepare`` (module docstring); ``park_timeout_ms`` (with ``ordering``) makes
    this delivery also dead-letter parked messages that waited longer than that.
    """
    if ordering and prepare is not None:
        raise ConfigError(f"consumer {consumer!r}: per-entity ordering cannot be combined with a prepare step")
    crash = crash_points or DISARMED
    now = clock.now_ms()
    expired = False
    try:
        with undone_on_error(session):
            if prepare is not None:
                if fast_path and already_seen(session, envelope.message_id, consumer, tables=tables):
                    return _duplicate(session, consumer, tables=tables)
                session.rollback()  # the external call holds no transaction (and no SQLite write lock)
                prepare(session, envelope)
                if session.in_transaction():
                    session.commit()
            session.info[NOW_KEY] = now
            if ordering:
                outcome, expired = ordering_module.apply(
                    session, envelope, tables=tables, consumer=consumer, handler=handler, now_ms=now,
                    expire_cutoff_ms=None if park_timeout_ms is None else now - park_timeout_ms)
                if outcome is Outcome.DUPLICATE:  # the claim found the key: nothing was written
                    return _duplicate(session, consumer, tables=tables)
            else:
                if not claim_if_absent(session, envelope, tables=tables, consumer=consumer, now_ms=now):
                    return _duplicate(session, consumer, tables=tables)
                handler(session, envelope)
                outcome = Outcome.PROCESSED
            commit_effect(session, crash, f"commit of {consumer} for {envelope.message_id}")
    except DuplicateDelivery:  # found after bookkeeping was written (a parked message): undone, then counted
        return _duplicate(session, consumer, tables=tables)
    crash.reached("consumer_after_commit_before_ack")
    if expired and park_timeout_ms is not None:
        try:
            ordering_module.expire_parked(session, tables=tables, consumer=consumer, now_ms=clock.now_ms(),
                                          timeout_ms=park_timeout_ms)
        except Exception as e:  # bookkeeping only (a concurrent delivery may have moved the same rows): the
            session.rollback()  # effect is committed and the message must be acked; a later delivery retries it
            log.warning("could not dead-letter expired parked messages of %s: %s", consumer, e)
    return outcome
