"""A counter never makes one transaction wait for another (celery_outbox/counters.py, striped counters).

The gap this closes (docs/scaling.md, "Several relays"): a relay frozen (SIGSTOP, a VM pause) after its
mark and before its COMMIT held the one ``published`` counter row, and every other relay's mark waited
on it until Postgres ended the frozen transaction. Real Postgres; the frozen process is a transaction
left open; the other one runs with a ``lock_timeout``, so waiting would fail it instead of hanging.
"""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables, counters
from celery_outbox.clock import ManualClock
from celery_outbox.ops.stats import collect
from celery_outbox.relay.queries import mark_published_pg
from tests.outbox_rows import insert_pending

pytestmark = pytest.mark.postgres

NO_WAITING = "SET LOCAL lock_timeout = '2s'"


def mark(session: Session, tables: Tables, seqs: list[int], now_ms: int) -> int:
    """The relay's mark of ``seqs`` (one statement, counted in the relay's ``published`` counter)."""
    stamped, _due = session.execute(mark_published_pg(tables, session.get_bind().dialect), {
        "now": now_ms, "ids": seqs, "scope": counters.RELAY, "name": counters.PUBLISHED,
        "stripe": counters.stripe_prefix(counters.PUBLISHED)}).one()
    return int(stamped)


def pending_seqs(sessions: sessionmaker[Session], tables: Tables) -> list[int]:
    with sessions() as s:
        return list(s.scalars(sa.select(tables.outbox.seq).order_by(tables.outbox.seq)))


def test_a_relay_frozen_after_its_mark_does_not_hold_another_relays_mark(
        pg_sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> None:
    # Given five pending rows, one already published and counted, and relay A frozen after marking two more
    # (its transaction still open, holding the counter's row it added to)
    insert_pending(pg_sessions, 1_000, 5, tables=tables)
    seqs = pending_seqs(pg_sessions, tables)
    with pg_sessions() as s:
        assert mark(s, tables, seqs[:1], 1_500) == 1
        s.commit()
    first, second = seqs[1:3], seqs[3:]
    frozen = pg_sessions()
    try:
        assert mark(frozen, tables, first, 2_000) == 2
        # When relay B marks the other two (with a lock timeout: waiting on A would fail it)
        with pg_sessions() as other:
            other.execute(sa.text(NO_WAITING))
            assert mark(other, tables, second, 2_000) == 2
            other.commit()
        # Then B's mark committed, counted in a stripe of its own while A holds the first row
        with pg_sessions() as s:
            assert counters.value(s, counters.RELAY, counters.PUBLISHED, tables=tables) == 3
        # And once A commits, the counter says every row published, once
        frozen.commit()
    finally:
        frozen.close()
    with pg_sessions() as s:
        assert counters.value(s, counters.RELAY, counters.PUBLISHED, tables=tables) == 5
        assert collect(s, tables=tables, clock=clock).counters[counters.RELAY][counters.PUBLISHED] == 5


def test_an_increment_never_waits_for_a_transaction_holding_the_counter(
        pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a counted duplicate, and a consumer's worker frozen inside a transaction that counted another
    with pg_sessions() as s:
        counters.stage_increment(s, "shipping", "duplicates", tables=tables)
        s.commit()
    frozen = pg_sessions()
    try:
        counters.stage_increment(frozen, "shipping", "duplicates", tables=tables)
        # When two other workers count theirs (each with a lock timeout)
        for _ in range(2):
            with pg_sessions() as other:
                other.execute(sa.text(NO_WAITING))
                counters.stage_increment(other, "shipping", "duplicates", 3, tables=tables)
                other.commit()
        # Then neither waited, and both committed
        with pg_sessions() as s:
            assert counters.value(s, "shipping", "duplicates", tables=tables) == 7
        frozen.commit()
    finally:
        frozen.close()
    # And the two of them shared one free stripe beside the frozen one's, rather than one each
    with pg_sessions() as s:
        assert counters.value(s, "shipping", "duplicates", tables=tables) == 8
        names = list(s.scalars(sa.select(tables.counters.name).where(tables.counters.consumer == "shipping")))
    assert len(names) == 2 and {counters.base_name(n) for n in names} == {"duplicates"}



def test_a_batchs_counts_are_one_statement_that_never_waits_for_a_transaction_holding_them(
        pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    from celery_outbox.inbox.batch import count_batch
    from tests.unit.test_inbox_claim import kinds, recorded

    def totals() -> list[int]:
        with pg_sessions() as s:
            return [counters.value(s, "search", n, tables=tables)
                    for n in (counters.DUPLICATES, counters.BATCHES, counters.BATCHED_MESSAGES)]

    # Given a batch consumer's worker frozen inside a batch that counted 5 messages, 2 of them duplicates
    frozen = pg_sessions()
    try:
        count_batch(frozen, "search", duplicates=2, size=5, tables=tables)
        # When two other batches count theirs (each with a lock timeout), one without any duplicate
        with recorded(pg_sessions) as seen:
            for duplicates, size in ((1, 3), (0, 4)):
                with pg_sessions() as other:
                    other.execute(sa.text(NO_WAITING))
                    count_batch(other, "search", duplicates=duplicates, size=size, tables=tables)
                    other.commit()
        # Then neither waited: each counted its three counters in ONE statement and committed
        assert [k for k in kinds(seen, tables) if k != "SET ?"] == ["WITH counters", "COMMIT"] * 2
        assert totals() == [1, 2, 7]
        frozen.commit()
    finally:
        frozen.close()
    # And with the frozen one committed, every count is there once
    assert totals() == [3, 3, 12]

def test_increments_racing_from_many_threads_add_up_exactly(
        pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given 8 threads, each counting 50 times in transactions that sometimes overlap
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def count() -> None:
        try:
            start.wait(10)
            for i in range(50):
                with pg_sessions() as s:
                    counters.stage_increment(s, counters.RELAY, counters.PUBLISH_FAILURES, i % 3 + 1, tables=tables)
                    s.commit()
        except BaseException as e:  # reported below, with the thread's own traceback
            errors.append(e)

    threads = [threading.Thread(target=count) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # Then nothing failed and the sum is exact (no increment lost to a stripe being started at the same time)
    assert errors == []
    with pg_sessions() as s:
        assert counters.value(s, counters.RELAY, counters.PUBLISH_FAILURES, tables=tables) == 8 * sum(
            i % 3 + 1 for i in range(50))
        rows = s.scalar(sa.select(sa.func.count()).select_from(tables.counters))
    assert rows is not None and 1 <= rows <= 8  # at most one stripe per transaction open at once


def test_rows_written_before_stripes_existed_still_count(
        pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a published counter as an earlier release kept it (one row named after the counter)
    with pg_sessions() as s:
        s.add(tables.counters(consumer=counters.RELAY, name=counters.PUBLISHED, value=40))
        s.commit()
    insert_pending(pg_sessions, 1_000, 2, tables=tables)
    # When this release's relay marks two rows
    with pg_sessions() as s:
        assert mark(s, tables, pending_seqs(pg_sessions, tables), 2_000) == 2
        s.commit()
    # Then they are added to that row, and the reader sees 42
    with pg_sessions() as s:
        assert {n: v for n, v in s.execute(sa.select(tables.counters.name, tables.counters.value))} == {
            counters.PUBLISHED: 42}


def test_only_the_counters_own_rows_take_its_increments(pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given rows that only look like stripes of "duplicates" (no reader would add them to it)
    with pg_sessions() as s:
        for name in ("duplicates#x", "duplicates#1#2", "duplicatesX"):
            s.add(tables.counters(consumer="shipping", name=name, value=100))
        s.commit()
    # When a duplicate is counted
    with pg_sessions() as s:
        counters.stage_increment(s, "shipping", "duplicates", tables=tables)
        s.commit()
    # Then it went to a row of its own, and what a reader sums is what was counted
    with pg_sessions() as s:
        values = {n: v for n, v in s.execute(sa.select(tables.counters.name, tables.counters.value))}
        assert counters.value(s, "shipping", "duplicates", tables=tables) == 1
    assert sorted(v for n, v in values.items() if n in ("duplicates#x", "duplicates#1#2", "duplicatesX")) == [100] * 3
