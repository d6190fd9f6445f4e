"""The inbox of a batch consumer: the effect of many messages and all their inbox rows commit together.

``handle_batch()`` is the batch form of ``inbox.handle``, and needs no Celery. ONE transaction:

1. claim every inbox key of the batch in ONE statement, ``INSERT ... VALUES (...), (...) ON CONFLICT
   DO NOTHING RETURNING message_id`` (Postgres, SQLite >= 3.35): the keys it returns are this batch's
   first deliveries; a key it does not return is already there (an earlier delivery, committed) and
   that message is a duplicate. A message twice in the same batch is claimed once: its later copies
   are duplicates too. The keys go in sorted, so two batches claiming overlapping keys on Postgres
   lock them in the same order and one waits for the other instead of deadlocking; as for a single
   claim, a key a concurrent, uncommitted batch holds makes this one wait for it, then find the key
   (it committed) or take it (it rolled back). The composite primary key is still the guarantee.
2. run the handler once, with the first deliveries only (in the order they came), flush;
3. count the duplicates and the batch (``counters.BATCHES``, ``counters.BATCHED_MESSAGES``) in the
   same transaction, commit.

A handler exception rolls everything back (no effect, no inbox row, no count) and propagates: the
caller (``celery_outbox.batch_delivery``) splits the batch, so one poison message cannot hold its
neighbours back. See docs/tasks.md, "Batch consumers".
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

from sqlalchemy.orm import Session

from celery_outbox import counters
from celery_outbox.clock import Clock
from celery_outbox.crashpoints import DISARMED
from celery_outbox.db import wrap_driver_errors
from celery_outbox.inbox.claim import NOW_KEY, CrashSite, commit_effect, undone_on_error
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from celery_outbox.sql import insert_for

BatchHandler = Callable[[Session, list[Envelope]], None]
"""The effect of a batch: write with the given session (one bulk statement, ideally), never commit."""

MAX_BATCH_SIZE = 1000
"""The largest batch: its claim binds four values per message, well under SQLite's 32,766 variables."""

__all__ = ["MAX_BATCH_SIZE", "BatchHandler", "claim_many", "handle_batch"]


def claim_many(session: Session, envelopes: Sequence[Envelope], *, tables: Tables, consumer: str,
               now_ms: int) -> set[uuid.UUID]:
    """Claim the inbox keys of ``envelopes`` (distinct message ids) in ONE statement inside the caller's
    transaction; returns the message ids this call inserted (the others were already there)."""
    if not envelopes:
        return set()
    table = tables.table(tables.inbox)
    rows = [{"message_id": e.message_id, "consumer": consumer, "type": e.type, "processed_at_ms": now_ms}
            for e in sorted(envelopes, key=lambda e: e.message_id)]
    stmt = (insert_for(session, table).values(rows)
            .on_conflict_do_nothing(index_elements=["message_id", "consumer"])
            .returning(table.c.message_id))
    with wrap_driver_errors(f"inbox insert of a batch for {consumer}"):
        return {uuid.UUID(str(m)) for m in session.execute(stmt).scalars()}


def handle_batch(session: Session, envelopes: Sequence[Envelope], *, tables: Tables, consumer: str,
                 handler: BatchHandler, clock: Clock, crash_points: CrashSite | None = None) -> list[Outcome]:
    """Handle one batch for ``consumer``; commits ``session``. Returns one outcome per envelope, in
    order: PROCESSED (the handler saw it; its inbox row committed with the effect) or DUPLICATE.

    A handler exception rolls everything back and propagates."""
    crash = crash_points or DISARMED
    now = clock.now_ms()
    first: dict[uuid.UUID, Envelope] = {}
    for envelope in envelopes:
        first.setdefault(envelope.message_id, envelope)
    with undone_on_error(session):
        session.info[NOW_KEY] = now
        claimed = claim_many(session, list(first.values()), tables=tables, consumer=consumer, now_ms=now)
        fresh = [e for e in first.values() if e.message_id in claimed]
        if fresh:
            handler(session, fresh)
        outcomes: list[Outcome] = []
        taken: set[uuid.UUID] = set()
        for envelope in envelopes:
            mine = envelope.message_id in claimed and envelope.message_id not in taken
            taken.add(envelope.message_id)
            outcomes.append(Outcome.PROCESSED if mine else Outcome.DUPLICATE)
        counters.stage_increment(session, consumer, counters.DUPLICATES, len(envelopes) - len(fresh), tables=tables)
        counters.stage_increment(session, consumer, counters.BATCHES, 1, tables=tables)
        counters.stage_increment(session, consumer, counters.BATCHED_MESSAGES, len(envelopes), tables=tables)
        commit_effect(session, crash, f"commit of a batch of {len(envelopes)} for {consumer}")
    crash.reached("consumer_after_commit_before_ack")
    return outcomes
