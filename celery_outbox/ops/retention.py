"""Retention: prune old inbox rows and published outbox rows in small batches.

Each batch is its own short transaction (``DELETE ... WHERE key IN (SELECT key ... LIMIT n)``), so no
statement holds locks over the whole history and the relay and consumers keep running alongside. The
inbox is never pruned below the broker's redelivery window: an inbox row deleted while the broker can
still redeliver its message would let a duplicate through as a second effect.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import counters
from celery_outbox.clock import Clock
from celery_outbox.db import is_postgres, wrap_driver_errors
from celery_outbox.errors import ValidationError
from celery_outbox.schema import Tables

log = logging.getLogger(__name__)

DEFAULT_BATCH = 5000


@dataclass(frozen=True, kw_only=True)
class PruneReport:
    inbox_deleted: int = 0
    inbox_batches: int = 0
    outbox_deleted: int = 0
    outbox_batches: int = 0
    inbox_cutoff_ms: int | None = None
    outbox_cutoff_ms: int | None = None

    def to_dict(self) -> dict[str, int | None]:
        return {
            "inbox_deleted": self.inbox_deleted, "inbox_batches": self.inbox_batches,
            "inbox_cutoff_ms": self.inbox_cutoff_ms,
            "outbox_deleted": self.outbox_deleted, "outbox_batches": self.outbox_batches,
            "outbox_cutoff_ms": self.outbox_cutoff_ms,
        }


def check_inbox_retention(inbox_older_than_ms: int, redelivery_window_ms: int) -> None:
    if inbox_older_than_ms < redelivery_window_ms:
        raise ValidationError(
            f"refusing to prune the inbox below the broker redelivery window: {inbox_older_than_ms} ms < "
            f"OUTBOX_BROKER_REDELIVERY_WINDOW_MS={redelivery_window_ms} ms (a redelivered message would "
            "find no inbox row and take effect twice); nothing was deleted"
        )


def _inbox_batch(session: Session, cutoff_ms: int, batch: int, *, tables: Tables) -> sa.Executable:
    keys = (
        sa.select(tables.inbox.message_id, tables.inbox.consumer)
        .where(tables.inbox.processed_at_ms < cutoff_ms)
        .order_by(tables.inbox.processed_at_ms)
        .limit(batch)
    )
    if is_postgres(session):
        keys = keys.with_for_update(skip_locked=True)
    # RETURNING the consumer lets the same transaction add to its ``inbox_pruned`` counter, so
    # "processed" (inbox rows + pruned rows) stays a monotonic counter for Prometheus.
    return sa.delete(tables.inbox).where(
        sa.tuple_(tables.inbox.message_id, tables.inbox.consumer).in_(keys)
    ).returning(tables.inbox.consumer).execution_options(synchronize_session=False)


def _outbox_batch(session: Session, cutoff_ms: int, batch: int, *, tables: Tables) -> sa.Executable:
    # Matches the partial index ix_outbox_published; pending and dead-lettered rows are never touched.
    seqs = (
        sa.select(tables.outbox.seq)
        .where(tables.outbox.published_at_ms.is_not(None), tables.outbox.published_at_ms < cutoff_ms)
        .order_by(tables.outbox.published_at_ms)
        .limit(batch)
    )
    if is_postgres(session):
        seqs = seqs.with_for_update(skip_locked=True)
    return sa.delete(tables.outbox).where(tables.outbox.seq.in_(seqs)).execution_options(
        synchronize_session=False)


def _drain(session_factory: sessionmaker[Session], build: Callable[..., sa.Executable],
           cutoff_ms: int, batch: int, what: str, count_pruned: bool = False, *, tables: Tables) -> tuple[int, int]:
    """Run batches until one comes back short; each batch commits on its own."""
    deleted = batches = 0
    while True:
        with session_factory() as session, wrap_driver_errors(f"pruning {what}"):
            stmt = build(session, cutoff_ms, batch, tables=tables)
            res = session.execute(stmt)
            if count_pruned:
                per_consumer = Counter(res.scalars().all())
                for consumer, pruned in per_consumer.items():
                    counters.stage_increment(session, consumer, counters.INBOX_PRUNED, pruned, tables=tables)
                n = sum(per_consumer.values())
            else:
                n = int(getattr(res, "rowcount", 0))
            session.commit()
        deleted += n
        batches += 1
        if n < batch:
            return deleted, batches


def prune(session_factory: sessionmaker[Session], *, tables: Tables, inbox_older_than_ms: int | None,
          published_older_than_ms: int | None, batch: int = DEFAULT_BATCH, clock: Clock,
          redelivery_window_ms: int) -> PruneReport:
    """Delete inbox rows processed before ``now - inbox_older_than_ms`` and outbox rows published
    before ``now - published_older_than_ms`` (None skips that side). Validates everything first."""
    if batch <= 0:
        raise ValidationError(f"batch must be > 0, got {batch}")
    if inbox_older_than_ms is None and published_older_than_ms is None:
        raise ValidationError("nothing to prune: give an inbox and/or a published-outbox age")
    for name, value in (("inbox age", inbox_older_than_ms), ("published age", published_older_than_ms)):
        if value is not None and value < 0:
            raise ValidationError(f"{name} must be >= 0, got {value}")
    if inbox_older_than_ms is not None:
        check_inbox_retention(inbox_older_than_ms, redelivery_window_ms)
    now = clock.now_ms()
    inbox = (0, 0)
    outbox = (0, 0)
    inbox_cutoff = outbox_cutoff = None
    if inbox_older_than_ms is not None:
        inbox_cutoff = now - inbox_older_than_ms
        inbox = _drain(session_factory, _inbox_batch, inbox_cutoff, batch, "inbox", tables=tables, count_pruned=True)
    if published_older_than_ms is not None:
        outbox_cutoff = now - published_older_than_ms
        outbox = _drain(session_factory, _outbox_batch, outbox_cutoff, batch, "published outbox rows", tables=tables)
    report = PruneReport(inbox_deleted=inbox[0], inbox_batches=inbox[1], outbox_deleted=outbox[0],
                         outbox_batches=outbox[1], inbox_cutoff_ms=inbox_cutoff, outbox_cutoff_ms=outbox_cutoff)
    log.info("pruned %s", report.to_dict())
    return report
