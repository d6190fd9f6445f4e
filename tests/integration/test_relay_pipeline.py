"""The pipelined relay on real Postgres (relay/loop.py ``_drain_pipelined``).

While batch N waits for its confirms, batch N+1 is claimed on a second connection: N must still be
unmarked (publish first, mark after), N+1 must be locked away from every other relay, and a broker
that goes away during N's wait must leave N and N+1 pending with no lock left behind.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables, counters
from celery_outbox.clock import ManualClock
from celery_outbox.errors import BrokerUnavailableError
from celery_outbox.messages import TaskMessage
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.relay.publisher import PublishReport, SendsAhead
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings
from tests.outbox_rows import insert_pending

pytestmark = pytest.mark.postgres


class AheadPublisher(InMemoryPublisher):
    """The broker takes each batch at ``send_batch``; ``during_wait`` runs while its confirms are awaited."""

    def __init__(self, during_wait: Callable[[Sequence[TaskMessage]], None]) -> None:
        super().__init__()
        self.during_wait = during_wait
        self.fail_wait_at: int | None = None
        self.sends = 0

    def send_batch(self, messages: Sequence[TaskMessage]) -> Callable[[], PublishReport]:
        report = self.publish_batch(messages)
        self.sends += 1
        n = self.sends

        def wait() -> PublishReport:
            self.during_wait(messages)
            if n == self.fail_wait_at:
                raise BrokerUnavailableError("connection lost while waiting for confirms")
            return report

        return wait


def unlocked_pending(sessions: sessionmaker[Session], tables: Tables) -> list[int]:
    """What another relay could claim right now."""
    with sessions() as s:
        seqs = s.execute(sa.select(tables.outbox.seq).where(tables.outbox.published_at_ms.is_(None))
                         .order_by(tables.outbox.seq).with_for_update(skip_locked=True)).scalars().all()
        s.rollback()
        return list(seqs)


def pending(sessions: sessionmaker[Session], tables: Tables) -> list[int]:
    with sessions() as s:
        return list(s.execute(sa.select(tables.outbox.seq).where(tables.outbox.published_at_ms.is_(None))
                              .order_by(tables.outbox.seq)).scalars().all())


def settings_for(tmp_path: Path, pg_url: str) -> Settings:
    return Settings(home=tmp_path, database_url=pg_url, namespace="pipe", relay_batch_size=10,
                    relay_max_in_flight_rows=20, routes={"OrderPlaced": ("shipping",)})


def test_the_next_batch_is_claimed_while_the_last_one_is_unconfirmed_and_unmarked(
        pg_sessions: sessionmaker[Session], pg_url: str, tmp_path: Path, clock: ManualClock, tables: Tables) -> None:
    # Given 45 pending rows and a pipelined relay (batches 10, 20, 20 capped by the in-flight bound)
    ids = [str(i) for i in insert_pending(pg_sessions, clock.now_ms(), 45, tables=tables, payload=lambda i, mid: {})]
    all_seqs = pending(pg_sessions, tables)
    seen: list[tuple[int, list[int], list[int]]] = []

    def during_wait(messages: Sequence[TaskMessage]) -> None:
        seen.append((len(messages), pending(pg_sessions, tables), unlocked_pending(pg_sessions, tables)))

    pub = AheadPublisher(during_wait)
    loop = RelayLoop(settings=settings_for(tmp_path, pg_url), tables=tables, session_factory=pg_sessions,
                     publisher=pub, clock=clock, listen=False)
    assert loop.pipelined
    # When it drains
    result = loop.drain_once()
    # Then every row went out once, in seq order, in growing batches bounded by the in-flight setting
    assert result.published == 45 and pub.message_ids() == ids
    assert [n for n, _, _ in seen] == [10, 20, 15]
    # And while batch N waited for its confirms nothing of it was marked (publish first, mark after),
    # and batch N+1 was already claimed: another relay could take neither
    done = 0
    for n, still_pending, claimable in seen:
        assert still_pending == all_seqs[done:]
        in_flight = all_seqs[done:done + n]
        next_size = {10: 20, 20: 20}.get(n, 0) if done + n < 45 else 0
        next_batch = all_seqs[done + n:done + n + next_size]
        assert claimable == all_seqs[done + n + len(next_batch):], (n, in_flight, next_batch)
        done += n
    assert pending(pg_sessions, tables) == []
    with pg_sessions() as s:
        counted = counters.value(s, counters.RELAY, counters.PUBLISHED, tables=tables)
    assert counted == 45  # counted in the mark's own statement, once per row
    loop.close()


def test_a_broker_lost_during_the_wait_leaves_both_batches_pending_and_unlocked(
        pg_sessions: sessionmaker[Session], pg_url: str, tmp_path: Path, clock: ManualClock, tables: Tables) -> None:
    # Given 50 pending rows and a broker that drops the connection while the 2nd batch is confirmed
    insert_pending(pg_sessions, clock.now_ms(), 50, tables=tables, payload=lambda i, mid: {})
    all_seqs = pending(pg_sessions, tables)
    pub = AheadPublisher(lambda messages: None)
    pub.fail_wait_at = 2
    loop = RelayLoop(settings=settings_for(tmp_path, pg_url), tables=tables, session_factory=pg_sessions,
                     publisher=pub, clock=clock, listen=False)
    # When it drains
    result = loop.drain_once()
    # Then the first batch is marked, the second (on the broker, unconfirmed) and the third (claimed,
    # never sent) are pending again, nothing is charged and no lock outlives the drain
    assert result.broker_unavailable and result.published == 10
    assert pending(pg_sessions, tables) == all_seqs[10:]
    assert unlocked_pending(pg_sessions, tables) == all_seqs[10:]
    with pg_sessions() as s:
        assert s.scalar(sa.select(sa.func.max(tables.outbox.attempts))) == 0
    assert loop.breaker.wait_ms(clock.now_ms()) > 0
    loop.close()


def test_the_kombu_publisher_sends_ahead() -> None:
    from celery_outbox.celery.kombu_publisher import KombuPublisher

    pub = KombuPublisher(broker_url="memory://", exchange_name="x", queue_names=["q"])
    assert isinstance(pub, SendsAhead)
    assert not isinstance(InMemoryPublisher(), SendsAhead)  # publishes and confirms in one call


@pytest.mark.parametrize("count", [True, False])
def test_the_array_mark_stamps_and_counts_only_rows_no_other_relay_stamped(
        pg_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables, count: bool) -> None:
    from celery_outbox.relay.dispatch import RelayConfig, claim_due, mark_batch

    # Given 5 claimed rows, the first of which another relay stamped meanwhile (at time 7)
    insert_pending(pg_sessions, clock.now_ms(), 5, tables=tables, payload=lambda i, mid: {})
    with pg_sessions() as s:
        rows = claim_due(s, clock.now_ms(), 10, tables=tables)
        s.rollback()
    with pg_sessions() as s:
        s.execute(sa.update(tables.outbox).where(tables.outbox.seq == rows[0].seq).values(published_at_ms=7))
        s.commit()
    # When this relay marks all 5 with one array parameter
    with pg_sessions() as s:
        config = RelayConfig(tables=tables, routes={}, max_message_bytes=10_000, max_attempts=3, base_delay_ms=1,
                             max_delay_ms=1)
        marked, failed, dead = mark_batch(s, clock.now_ms(), config, published=rows, failed={}, count=count)
        s.commit()
    # Then it stamped (and, when asked, counted) the 4 it held, and left the other relay's stamp alone
    assert (marked, failed, dead) == (4, 0, 0)
    with pg_sessions() as s:
        stamps = dict(s.execute(sa.select(tables.outbox.seq, tables.outbox.published_at_ms)).all())
        counted = counters.value(s, counters.RELAY, counters.PUBLISHED, tables=tables)
    assert stamps[rows[0].seq] == 7 and all(stamps[r.seq] == clock.now_ms() for r in rows[1:])
    assert counted == (4 if count else 0)
