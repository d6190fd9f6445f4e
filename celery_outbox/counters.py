"""Monotonic counters kept in the database (table ``outbox_counters``), for metrics and stats.

A counter is staged in the transaction that does the counted work (the relay's mark, a consumer's
dead letter, a retention batch), so it is exact across processes and restarts; Prometheus reads them
at scrape time (``celery_outbox.ops.metrics``). Hot paths stay free of them: a consumer's processed count is
derived (inbox rows + pruned inbox rows), not incremented per message.
"""

from __future__ import annotations

import logging

from sqlalchemy import exc
from sqlalchemy.orm import Session

from celery_outbox.schema import Tables
from celery_outbox.sql import upsert

log = logging.getLogger(__name__)

RELAY = "_relay"  # the scope of the relay's counters (a consumer name never starts with "_")
PUBLISHED = "published"
PUBLISH_FAILURES = "publish_failures"
BROKER_UNAVAILABLE = "broker_unavailable"
DEAD_LETTERED = "dead_lettered"
INBOX_PRUNED = "inbox_pruned"
# The reconciler's (relay/reconcile.py), in the RELAY scope: messages it sent again because they never arrived.
RECONCILED = "reconciled"  # every message sent again, all kinds
RECONCILED_EVENTS = "reconciled_events"  # (event, consumer) pairs
RECONCILED_TASKS = "reconciled_tasks"  # @outbox.task messages
RECONCILED_PLAIN_TASKS = "reconciled_plain_tasks"  # plain task messages


def stage_increment(session: Session, scope: str, name: str, by: int = 1, *, tables: Tables) -> None:
    """``counter(scope, name) += by`` inside the caller's transaction (the caller commits)."""
    if by <= 0:
        return
    session.execute(upsert(session, tables.counters, {"consumer": scope, "name": name, "value": by},
                           keys=("consumer", "name"), update={"value": tables.counters.value + by}))


def increment(session: Session, scope: str, name: str, by: int = 1, *, tables: Tables) -> None:
    """``counter(scope, name) += by`` in a small transaction of its own, for work that has already
    committed (or rolled back). Observability only: a failure is logged, never raised."""
    try:
        stage_increment(session, scope, name, by, tables=tables)
        session.commit()
    except exc.DBAPIError as e:
        session.rollback()
        log.warning("could not count %s for %s: %s", name, scope, e.orig)
