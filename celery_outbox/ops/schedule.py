"""The scheduled retention job: what the hourly prune deletes, wherever it runs.

Beat's ``celery_outbox.prune`` task and the standalone ``outbox relay`` loop both call
``scheduled_prune``, under the ``prune`` lease (``celery_outbox.relay.lease``), so the same
defaults apply and one of them runs it per hour.
"""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import Clock
from celery_outbox.ops import retention
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings

DEFAULT_INBOX_RETENTION_MS = 7 * 24 * 3600 * 1000
DEFAULT_PUBLISHED_RETENTION_MS = 24 * 3600 * 1000
PRUNE_EVERY_S = 3600.0
PRUNE_EVERY_MS = int(PRUNE_EVERY_S * 1000)


def default_inbox_retention_ms(settings: Settings) -> int:
    """Seven days, never below the broker redelivery window (a redelivery must find its inbox row)."""
    return max(DEFAULT_INBOX_RETENTION_MS, settings.broker_redelivery_window_ms)


def scheduled_prune(session_factory: sessionmaker[Session], *, settings: Settings, tables: Tables, clock: Clock,
                    inbox_older_than_ms: int | None = None, published_older_than_ms: int | None = None,
                    batch: int = retention.DEFAULT_BATCH) -> retention.PruneReport:
    """Retention with the scheduled defaults (inbox: max(7 d, redelivery window); published rows: 1 d)."""
    inbox = default_inbox_retention_ms(settings) if inbox_older_than_ms is None else inbox_older_than_ms
    published = DEFAULT_PUBLISHED_RETENTION_MS if published_older_than_ms is None else published_older_than_ms
    return retention.prune(session_factory, tables=tables, inbox_older_than_ms=inbox,
                           published_older_than_ms=published, batch=batch, clock=clock,
                           redelivery_window_ms=settings.broker_redelivery_window_ms)
