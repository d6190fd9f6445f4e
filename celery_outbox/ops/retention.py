"""Retention: prune old inbox rows and published outbox rows in small batches.

Each batch is its own short transaction (``DELETE ... WHERE key IN (SELECT key ... LIMIT n)``), so no
statement holds locks over the whole history and the relay and consumers keep running alongside. The
inbox is never pruned below the broker's redelivery window: an inbox row deleted while the broker can
still redeliver its message would let a duplicate through as a second effect. Task receipts (the plain
tasks' record of having reached a worker, inbox/receipts.py) are pruned with the inbox, at its cutoff:
the settings keep that window longer than the reconciler's plain-task window.

On the partitioned layout (Postgres, docs/partitioning.md) the outbox side deletes nothing: it creates
the partitions ahead and drops every old partition whose rows are all published past the cutoff
(ops/partitions.py); a partition holding a pending or dead-lettered row stays. The inbox side is the same.

Progress: ``prune(progress=...)`` calls back once when each side starts (``batch == 0``, with the
number of rows it expects to delete) and after every committed batch, so a caller can render a bar
(the CLI does, with rich) without this module knowing how.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import counters, layout
from celery_outbox.clock import Clock
from celery_outbox.db import is_postgres, wrap_driver_errors
from celery_outbox.errors import DatabaseError, ValidationError
from celery_outbox.ops import partitions
from celery_outbox.schema import Tables

log = logging.getLogger(__name__)

DEFAULT_BATCH = 5000


@dataclass(frozen=True, kw_only=True)
class PruneReport:
    inbox_deleted: int = 0
    inbox_batches: int = 0
    receipts_deleted: int = 0
    outbox_deleted: int = 0
    outbox_batches: int = 0
    inbox_cutoff_ms: int | None = None
    outbox_cutoff_ms: int | None = None
    outbox_partitions_dropped: int | None = None  # None: the plain layout (batched DELETE)

    def to_dict(self) -> dict[str, int | None]:
        partitioned = {} if self.outbox_partitions_dropped is None else {
            "outbox_partitions_dropped": self.outbox_partitions_dropped}
        return {**partitioned,
            "inbox_deleted": self.inbox_deleted, "inbox_batches": self.inbox_batches,
            "inbox_cutoff_ms": self.inbox_cutoff_ms, "receipts_deleted": self.receipts_deleted,
            "outbox_deleted": self.outbox_deleted, "outbox_batches": self.outbox_batches,
            "outbox_cutoff_ms": self.outbox_cutoff_ms,
        }


@dataclass(frozen=True, kw_only=True)
class PruneProgress:
    """One step of a prune: ``batch == 0`` announces a side, every later call reports a committed batch."""

    target: Literal["inbox", "outbox", "receipts"]
    batch: int  # 0 when the side starts, then 1, 2, ... per committed batch
    deleted: int  # rows this batch deleted (0 for the start)
    total_deleted: int  # rows this side has deleted so far
    expected: int  # rows older than the cutoff when the side started (rows written meanwhile may add to it)


PruneCallback = Callable[[PruneProgress], None]


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


def _receipts_batch(session: Session, cutoff_ms: int, batch: int, *, tables: Tables) -> sa.Executable:
    r = tables.receipts
    keys = sa.select(r.task_id).where(r.received_at_ms < cutoff_ms).order_by(r.received_at_ms).limit(batch)
    if is_postgres(session):
        keys = keys.with_for_update(skip_locked=True)
    return sa.delete(r).where(r.task_id.in_(keys)).execution_options(synchronize_session=False)


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


def _count_inbox(cutoff_ms: int, *, tables: Tables) -> sa.Select[int]:
    return sa.select(sa.func.count()).select_from(tables.inbox).where(tables.inbox.processed_at_ms < cutoff_ms)


def _count_outbox(cutoff_ms: int, *, tables: Tables) -> sa.Select[int]:
    return sa.select(sa.func.count()).select_from(tables.outbox).where(
        tables.outbox.published_at_ms.is_not(None), tables.outbox.published_at_ms < cutoff_ms)


def _drain(session_factory: sessionmaker[Session], build: Callable[..., sa.Executable],
           cutoff_ms: int, batch: int, what: str, count_pruned: bool = False, *, tables: Tables,
           target: Literal["inbox", "outbox", "receipts"], progress: PruneCallback | None = None) -> tuple[int, int]:
    """Run batches until one comes back short; each batch commits on its own."""
    deleted = batches = 0
    expected = 0
    if progress is not None:
        count = _count_inbox if target == "inbox" else _count_outbox
        with session_factory() as session, wrap_driver_errors(f"counting {what}"):
            expected = int(session.execute(count(cutoff_ms, tables=tables)).scalar_one())
            session.rollback()
        progress(PruneProgress(target=target, batch=0, deleted=0, total_deleted=0, expected=expected))
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
        if progress is not None:
            progress(PruneProgress(target=target, batch=batches, deleted=n, total_deleted=deleted,
                                   expected=max(expected, deleted)))
        if n < batch:
            return deleted, batches


def _partitioned(session_factory: sessionmaker[Session], *, tables: Tables) -> bool:
    with session_factory() as session, wrap_driver_errors("reading the outbox layout"):
        return layout.is_partitioned(session, tables=tables)


def _drop_partitions(session_factory: sessionmaker[Session], published_older_than_ms: int, *, tables: Tables,
                     clock: Clock, progress: PruneCallback | None) -> tuple[int, int]:
    """The partitioned layout's outbox retention: partitions ahead, then DROP of the expired ones.
    Returns (rows the dropped partitions held, partitions dropped); a "batch" is one partition here."""
    try:
        partitions.ensure_partitions(session_factory, tables=tables)
    except DatabaseError as e:  # a lock not granted in time: the drops below still run, the next prune retries
        log.warning("partitions ahead not created: %s", e)
    report = partitions.drop_expired(session_factory, tables=tables, published_older_than_ms=published_older_than_ms,
                                     clock=clock)
    if progress is not None:
        progress(PruneProgress(target="outbox", batch=0, deleted=0, total_deleted=0, expected=report.rows))
        if report.dropped:
            progress(PruneProgress(target="outbox", batch=len(report.dropped), deleted=report.rows,
                                   total_deleted=report.rows, expected=report.rows))
    return report.rows, len(report.dropped)


def prune(session_factory: sessionmaker[Session], *, tables: Tables, inbox_older_than_ms: int | None,
          published_older_than_ms: int | None, batch: int = DEFAULT_BATCH, clock: Clock,
          redelivery_window_ms: int, progress: PruneCallback | None = None) -> PruneReport:
    """Delete inbox rows processed before ``now - inbox_older_than_ms`` and outbox rows published
    before ``now - published_older_than_ms`` (None skips that side). Validates everything first.
    ``progress`` is called when each side starts and after each committed batch (``PruneProgress``)."""
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
    receipts = (0, 0)
    outbox = (0, 0)
    inbox_cutoff = outbox_cutoff = None
    if inbox_older_than_ms is not None:
        inbox_cutoff = now - inbox_older_than_ms
        inbox = _drain(session_factory, _inbox_batch, inbox_cutoff, batch, "inbox", tables=tables, count_pruned=True,
                       target="inbox", progress=progress)
        receipts = _drain(session_factory, _receipts_batch, inbox_cutoff, batch, "task receipts", tables=tables,
                          target="receipts")
    dropped: int | None = None
    if published_older_than_ms is not None:
        outbox_cutoff = now - published_older_than_ms
        if _partitioned(session_factory, tables=tables):
            outbox = _drop_partitions(session_factory, published_older_than_ms, tables=tables, clock=clock,
                                      progress=progress)
            dropped = outbox[1]
        else:
            outbox = _drain(session_factory, _outbox_batch, outbox_cutoff, batch, "published outbox rows",
                            tables=tables, target="outbox", progress=progress)
    report = PruneReport(inbox_deleted=inbox[0], inbox_batches=inbox[1], receipts_deleted=receipts[0],
                         outbox_deleted=outbox[0],
                         outbox_batches=outbox[1], inbox_cutoff_ms=inbox_cutoff, outbox_cutoff_ms=outbox_cutoff,
                         outbox_partitions_dropped=dropped)
    log.info("pruned %s", report.to_dict())
    return report
