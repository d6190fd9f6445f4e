"""Review of the reconcile watermark cut (issue #24): two reconcile passes that disagree on the window's end
(a clock ahead or behind on another host, a pass that overran its lease while the next one ran) must never
move the watermark back. A watermark moved back re-checks a span another pass already checked and sends its
lost messages again while the first re-send is still queued: a second run of a plain task, which has no inbox."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables, counters
from celery_outbox.clock import ManualClock
from celery_outbox.messages import TaskMessage
from celery_outbox.relay.reconcile import ReconcileResult, event_watermark, reconcile
from celery_outbox.testing.memory import InMemoryPublisher

pytestmark = pytest.mark.postgres

ROUTES = {"OrderPlaced": ("shipping",)}
AFTER_MS = 1_000
T0 = 1_700_000_000_000


def run(sessions: sessionmaker[Session], clock: ManualClock, tables: Tables,
        publisher: InMemoryPublisher | None = None) -> ReconcileResult:
    with sessions() as s:
        return reconcile(s, publisher or InMemoryPublisher(), clock, tables=tables, routes=ROUTES, namespace="rv",
                         max_message_bytes=1 << 20, older_than_ms=AFTER_MS)


def watermark(sessions: sessionmaker[Session], tables: Tables) -> tuple[int, int]:
    c = tables.counters
    mark_ms, mark_seq = event_watermark("shipping")
    with sessions() as s:
        found = {name: value for name, value in s.execute(sa.select(c.name, c.value).where(
            c.consumer == counters.RELAY, c.name.in_((mark_ms, mark_seq))))}
    return int(found[mark_ms]), int(found[mark_seq])


def published_event(sessions: sessionmaker[Session], tables: Tables, published_at_ms: int) -> uuid.UUID:
    """An event published at ``published_at_ms`` that never reached its consumer (no inbox row)."""
    mid = uuid.uuid4()
    with sessions() as s:
        s.add(tables.outbox(message_id=mid, type="OrderPlaced", payload={}, headers={}, created_at_ms=published_at_ms,
                            next_attempt_at_ms=published_at_ms, attempts=0, published_at_ms=published_at_ms))
        s.commit()
    return mid


def test_a_pass_whose_clock_is_behind_does_not_move_the_watermark_back(
        pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    ahead, behind = ManualClock(start_ms=T0 + 5_000), ManualClock(start_ms=T0)
    # Given a first pass (it sets the watermark) and an event published since that never reached its consumer
    run(pg_sessions, behind, tables)
    published_event(pg_sessions, tables, T0 + 3_000)
    # And a pass on a host whose clock runs 5 s ahead: it sends the event again and checks through T0 + 4 s
    assert run(pg_sessions, ahead, tables).events == 1
    assert watermark(pg_sessions, tables)[0] == T0 + 5_000 - AFTER_MS
    # When a pass on a host whose clock is behind runs (the beat task, another relay): its window ends at T0 + 2 s
    behind.advance(3_000)
    run(pg_sessions, behind, tables)
    # Then the watermark stays where the pass ahead left it
    assert watermark(pg_sessions, tables)[0] == T0 + 5_000 - AFTER_MS
    # And the next pass does not send the event a second time (its first re-send may still be queued)
    ahead.advance(1_000)
    assert run(pg_sessions, ahead, tables).events == 0


def test_a_pass_that_publishes_while_another_moves_the_watermark_does_not_move_it_back(
        pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    ahead, behind = ManualClock(start_ms=T0 + 5_000), ManualClock(start_ms=T0)
    run(pg_sessions, ManualClock(start_ms=T0 - 1_000), tables)
    published_event(pg_sessions, tables, T0 - 1_000)
    published_event(pg_sessions, tables, T0 + 1_000)
    # Given a pass (its window ends at T0 - 1 s) that found the first lost event and is publishing it again,
    # and meanwhile another pass (its window ends at T0 + 4 s) runs to the end: it finds both events and
    # moves the watermark on
    others: list[ReconcileResult] = []

    def meanwhile(_messages: Sequence[TaskMessage]) -> None:
        if not others:
            others.append(run(pg_sessions, ahead, tables))

    assert run(pg_sessions, behind, tables, InMemoryPublisher(before_publish=meanwhile)).events == 1
    assert others and others[0].events == 2
    # When the first pass writes its watermark after its publish
    # Then the watermark stays where the other pass left it: the window it checked is not checked again,
    # and the second event is not sent a second time
    assert watermark(pg_sessions, tables)[0] == T0 + 5_000 - AFTER_MS
    ahead.advance(1_000)
    assert run(pg_sessions, ahead, tables).events == 0
