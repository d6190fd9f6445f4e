"""docs/design.md, rule 2: publish FIRST, mark AFTER. A crash in between costs a duplicate, never a loss.

The wrong order (mark first) is assembled here from the relay's own steps, run through the same
crash, and shown to LOSE the message: the order of the two steps is what the guarantee rests on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import Clock, ManualClock
from celery_outbox.relay.dispatch import RelayConfig, build_messages, claim_due, dispatch_batch, mark_batch
from celery_outbox.relay.publisher import Publisher
from celery_outbox.schema import Tables
from celery_outbox.testing.memory import InMemoryPublisher, PublisherCrashed
from tests.outbox_rows import insert_pending

ROUTES = {"OrderPlaced": ("shipping", "billing", "search")}
OPTS: dict[str, Any] = {"batch_size": 10, "max_attempts": 3, "base_delay_ms": 1_000, "max_delay_ms": 60_000,
                        "routes": ROUTES, "max_message_bytes": 10_000, "namespace": "t"}


class Died(BaseException):
    """The relay process died at a crash point."""


class DieAt:
    def __init__(self, name: str) -> None:
        self.name = name

    def reached(self, name: str) -> None:
        if name == self.name:
            raise Died(name)


def insert(sessions: sessionmaker[Session], clock: ManualClock, tables: Tables, n: int) -> set[str]:
    return {str(i) for i in insert_pending(sessions, clock.now_ms(), n, tables=tables, payload=lambda i, mid: {})}

def dispatch_batch_mark_first(session: Session, publisher: Publisher, clock: Clock, *, tables: Tables,
                              die_between: bool = False) -> None:
    """The WRONG relay: marks rows published, commits, then publishes (at-most-once)."""
    now = clock.now_ms()
    rows = claim_due(session, now, OPTS["batch_size"], tables=tables)
    built = build_messages(rows, routes=ROUTES, namespace="t", max_message_bytes=10_000)
    config = RelayConfig(tables=tables, routes=ROUTES, namespace="t", max_message_bytes=10_000, max_attempts=3,
                         base_delay_ms=1_000, max_delay_ms=60_000)
    mark_batch(session, now, config, published=rows, failed={})
    session.commit()
    if die_between:
        raise Died("between mark and publish")
    publisher.publish_batch(built.messages)


def publish_first(session: Session, publisher: Publisher, clock: Clock, *, tables: Tables,
                  die_between: bool = False) -> None:
    dispatch_batch(session, publisher, clock, tables=tables, **OPTS,
                   crash_points=DieAt("after_publish_before_mark") if die_between else None)


def crash_once_then_restart(relay: Callable[..., None], sessions: sessionmaker[Session], clock: ManualClock,
                            pub: InMemoryPublisher, tables: Tables) -> None:
    # When the relay dies between its two steps ...
    with sessions() as s, pytest.raises(Died):
        relay(s, pub, clock, tables=tables, die_between=True)
    # ... and a fresh relay process runs until there is nothing left
    for _ in range(5):
        with sessions() as s:
            relay(s, pub, clock, tables=tables)


def test_publish_first_crash_between_publish_and_mark_duplicates_never_loses(
        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given 4 pending rows
    ids = insert(sqlite_sessions, clock, tables, 4)
    pub = InMemoryPublisher()
    crash_once_then_restart(publish_first, sqlite_sessions, clock, pub, tables)
    # Then every message reached every consumer; the crashed batch went out twice
    assert set(pub.message_ids()) == ids
    assert all(n in (1, 2) for n in pub.deliveries().values())
    assert pub.duplicates() == 4 * len(ROUTES["OrderPlaced"])
    with sqlite_sessions() as s:
        assert s.scalar(sa.select(sa.func.count()).where(tables.outbox.published_at_ms.is_(None))) == 0


def test_mark_first_under_the_same_crash_loses_the_messages(sqlite_sessions: sessionmaker[Session],
                                                           clock: ManualClock, tables: Tables) -> None:
    # Given the same 4 rows and the same crash, but the steps swapped
    ids = insert(sqlite_sessions, clock, tables, 4)
    pub = InMemoryPublisher()
    crash_once_then_restart(dispatch_batch_mark_first, sqlite_sessions, clock, pub, tables)
    # Then the rows say "published" but the broker never got them: lost, and nothing will retry
    with sqlite_sessions() as s:
        assert s.scalar(sa.select(sa.func.count()).where(tables.outbox.published_at_ms.is_(None))) == 0
    assert set(pub.message_ids()) != ids
    assert set(pub.message_ids()) == set()


def test_publisher_dying_after_the_broker_got_the_batch_is_republished_on_restart(
        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given a publisher that hands the batch to the broker and then the process dies
    ids = insert(sqlite_sessions, clock, tables, 3)
    pub = InMemoryPublisher()
    pub.crash_after_delivery()
    with sqlite_sessions() as s, pytest.raises(PublisherCrashed):
        dispatch_batch(s, pub, clock, tables=tables, **OPTS)
    # Then nothing was marked
    with sqlite_sessions() as s:
        assert s.scalar(sa.select(sa.func.count()).where(tables.outbox.published_at_ms.is_(None))) == 3
    # When the relay restarts, then it publishes again: only duplicates, no loss
    with sqlite_sessions() as s:
        assert dispatch_batch(s, pub, clock, tables=tables, **OPTS).published == 3
    assert set(pub.message_ids()) == ids
    assert set(pub.deliveries().values()) == {2}
