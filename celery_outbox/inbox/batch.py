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
   On Postgres through a libpq driver the statement is SQL text compiled once per pooled connection
   (``claim.driver_sql``) that takes the batch's ids and types as two arrays (``unnest``): the same
   statement for any batch size, with none of SQLAlchemy's per-row bind parameters to build, compile
   and cache-key (the multi-row ``VALUES`` elsewhere);
2. run the handler once, with the first deliveries only (in the order they came), flush;
3. count the duplicates and the batch (``counters.BATCHES``, ``counters.BATCHED_MESSAGES``) in the
   same transaction (``count_batch``: one statement on Postgres), commit.

A handler exception rolls everything back (no effect, no inbox row, no count) and propagates: the
caller (``celery_outbox.batch_delivery``) splits the batch, so one poison message cannot hold its
neighbours back. See docs/tasks.md, "Batch consumers".
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox import counters
from celery_outbox.clock import Clock
from celery_outbox.crashpoints import DISARMED
from celery_outbox.db import wrap_driver_errors
from celery_outbox.inbox.claim import NOW_KEY, CrashSite, commit_effect, driver_sql, execute_driver_sql, undone_on_error
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from celery_outbox.sql import insert_for, key_columns

BatchHandler = Callable[[Session, list[Envelope]], None]
"""The effect of a batch: write with the given session (one bulk statement, ideally), never commit."""

MAX_BATCH_SIZE = 1000
"""The largest batch: its claim binds four values per message, well under SQLite's 32,766 variables."""

__all__ = ["MAX_BATCH_SIZE", "BatchHandler", "claim_many", "count_batch", "handle_batch"]


def claim_many(session: Session, envelopes: Sequence[Envelope], *, tables: Tables, consumer: str,
               now_ms: int) -> set[uuid.UUID]:
    """Claim the inbox keys of ``envelopes`` (distinct message ids) in ONE statement inside the caller's
    transaction; returns the message ids this call inserted (the others were already there)."""
    if not envelopes:
        return set()
    table = tables.table(tables.inbox)
    ordered = sorted(envelopes, key=lambda e: e.message_id)
    with wrap_driver_errors(f"inbox insert of a batch for {consumer}"):
        connection = session.connection()
        sql = driver_sql(connection, ("claim_many", table), lambda: _claim_unnest(connection, table))
        if sql is not None:
            inserted = execute_driver_sql(connection, sql, {
                "message_ids": [str(e.message_id) for e in ordered], "types": [e.type for e in ordered],
                "consumer": consumer, "processed_at_ms": now_ms}).scalars()
        else:
            rows = [{"message_id": e.message_id, "consumer": consumer, "type": e.type, "processed_at_ms": now_ms}
                    for e in ordered]
            inserted = session.execute(insert_for(session, table).values(rows)
                                       .on_conflict_do_nothing(index_elements=list(key_columns(table)))
                                       .returning(table.c.message_id)).scalars()
        return {m if isinstance(m, uuid.UUID) else uuid.UUID(str(m)) for m in inserted}


def _claim_unnest(connection: sa.Connection, table: sa.Table) -> sa.TextClause:
    """Postgres: the batch's claim with its ids and types as two arrays, in their order (``claim_many``)."""
    name = connection.dialect.identifier_preparer.format_table(table)
    key = ", ".join(key_columns(table))
    return sa.text(
        f"INSERT INTO {name} (message_id, consumer, type, processed_at_ms) "
        "SELECT m, :consumer, t, :processed_at_ms "
        "FROM unnest(CAST(:message_ids AS uuid[]), CAST(:types AS varchar[])) AS claimed (m, t) "
        f"ON CONFLICT ({key}) DO NOTHING RETURNING message_id")


def count_batch(session: Session, consumer: str, *, duplicates: int, size: int, tables: Tables) -> None:
    """Stage the batch's counts in its transaction: one batch of ``size`` messages, ``duplicates`` of them
    absorbed. On Postgres through a libpq driver, ONE statement compiled once per pooled connection
    (``counters.striped_increments``); elsewhere ``counters.stage_increment`` for each."""
    amounts = [(name, by) for name, by in ((counters.DUPLICATES, duplicates), (counters.BATCHES, 1),
                                           (counters.BATCHED_MESSAGES, size)) if by > 0]
    table = tables.table(tables.counters)
    connection = session.connection()
    # one text per number of counters (the names are parameters): a batch without duplicates plans two, not three
    sql = driver_sql(connection, ("count_batch", table, len(amounts)), lambda: sa.text(counters.striped_increments(
        connection.dialect.identifier_preparer.format_table(table), len(amounts))))
    if sql is None:
        for name, by in amounts:
            counters.stage_increment(session, consumer, name, by, tables=tables)
        return
    with wrap_driver_errors(f"counting a batch for {consumer}"):
        execute_driver_sql(connection, sql, counters.increments_params(consumer, amounts))


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
        count_batch(session, consumer, duplicates=len(envelopes) - len(fresh), size=len(envelopes), tables=tables)
        commit_effect(session, crash, f"commit of a batch of {len(envelopes)} for {consumer}")
    crash.reached("consumer_after_commit_before_ack")
    return outcomes
