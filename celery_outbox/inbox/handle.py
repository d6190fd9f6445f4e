"""The inbox: an effect and its ``(message_id, consumer)`` row commit together, or not at all.

``handle()`` is the whole idempotent-consumer algorithm and needs no Celery:

1. optional fast path: "already seen?" (a read; skipping it changes nothing but speed);
2. optional ``prepare`` step OUTSIDE the transaction, for effects outside the database that take an
   idempotency key (an e-mail provider): a retry repeats the call with the same key, the provider
   answers it once, and no database lock is held during the slow call;
3. ONE transaction: claim the inbox key (INSERT, flushed first, so a parallel duplicate waits on the
   row lock and then fails instead of running the effect), run the handler's effect, commit.

A unique violation on the inbox rolls everything back and returns ``Outcome.DUPLICATE``: the
composite primary key is the guarantee, the fast path only an optimisation. Writing the inbox row in
a transaction of its own before the effect would lose the effect on a crash between the two (see
tests/unit/test_consumer_inbox.py::test_mirror_bug_loses_the_effect); the design forbids it.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from celery_outbox import counters
from celery_outbox.clock import Clock
from celery_outbox.crashpoints import DISARMED
from celery_outbox.db import wrap_driver_errors
from celery_outbox.errors import ConfigError
from celery_outbox.inbox import ordering as ordering_module
from celery_outbox.inbox.claim import (
    DUPLICATES,
    NOW_KEY,
    CrashSite,
    DuplicateDelivery,
    Handler,
    Prepare,
    already_seen,
    claim,
    claim_if_absent,
    effect_now_ms,
)
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables

log = logging.getLogger(__name__)

__all__ = ["DUPLICATES", "NOW_KEY", "CrashSite", "DuplicateDelivery", "Handler", "Prepare", "already_seen", "claim",
           "claim_if_absent", "effect_now_ms", "handle", "increment_counter"]


def increment_counter(session: Session, consumer: str, name: str, by: int = 1, *, tables: Tables) -> None:
    """``ConsumerCounter(consumer, name) += by`` in its own small transaction (never raises)."""
    counters.increment(session, consumer, name, by, tables=tables)


def handle(session: Session, envelope: Envelope, *, tables: Tables, consumer: str, handler: Handler, clock: Clock,
           fast_path: bool = True, ordering: bool = False, crash_points: CrashSite | None = None,
           prepare: Prepare | None = None) -> Outcome:
    """Handle one delivery of ``envelope`` for ``consumer``; commits ``session``.

    Returns PROCESSED, DUPLICATE, or (with ``ordering``) STALE / PARKED. A handler exception rolls
    everything back (no effect, no inbox row) and propagates: the caller redelivers.
    """
    if ordering and prepare is not None:
        raise ConfigError(f"consumer {consumer!r}: per-entity ordering cannot be combined with a prepare step")
    crash = crash_points or DISARMED
    now = clock.now_ms()
    try:
        if fast_path and already_seen(session, envelope.message_id, consumer, tables=tables):
            raise DuplicateDelivery(f"{envelope.message_id}/{consumer}")
        if prepare is not None:
            session.rollback()  # the external call holds no transaction (and no SQLite write lock)
            prepare(session, envelope)
            if session.in_transaction():
                session.commit()
        session.info[NOW_KEY] = now
        if ordering:
            outcome = ordering_module.apply(session, envelope, tables=tables, consumer=consumer, handler=handler, now_ms=now)
        else:
            claim(session, envelope, tables=tables, consumer=consumer, now_ms=now)
            handler(session, envelope)
            outcome = Outcome.PROCESSED
        session.flush()
        crash.reached("consumer_before_commit")
        with wrap_driver_errors(f"commit of {consumer} for {envelope.message_id}"):
            session.commit()
    except DuplicateDelivery:
        session.rollback()
        increment_counter(session, consumer, DUPLICATES, tables=tables)
        return Outcome.DUPLICATE
    except BaseException:
        session.rollback()
        raise
    finally:
        session.info.pop(NOW_KEY, None)
    crash.reached("consumer_after_commit_before_ack")
    return outcome
