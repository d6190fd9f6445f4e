"""The relay on real Postgres: SKIP LOCKED claims with two relays at once, and the NOTIFY wake-up."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.clock import ManualClock, SystemClock
from celery_outbox.relay.dispatch import BatchResult, dispatch_with_settings
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings
from tests.outbox_rows import insert_pending

pytestmark = pytest.mark.postgres


def insert(sessions: sessionmaker[Session], now_ms: int, n: int, tables: Tables) -> set[str]:
    return {str(i) for i in insert_pending(sessions, now_ms, n, tables=tables, payload=lambda i, mid: {})}


def pending(sessions: sessionmaker[Session], tables: Tables) -> int:
    with sessions() as s:
        return int(s.scalar(sa.select(sa.func.count()).where(tables.outbox.published_at_ms.is_(None))) or 0)


def wait_for(cond: Any, what: str, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_two_relays_at_once_publish_every_row_once(pg_sessions: sessionmaker[Session], pg_url: str,
                                                  tmp_path: Path, clock: ManualClock, tables: Tables) -> None:
    # Given 600 pending rows and two relays started together on the same database
    ids = insert(pg_sessions, clock.now_ms(), 600, tables)
    settings = Settings(home=tmp_path, database_url=pg_url, namespace="two", relay_batch_size=25,
                        routes={"OrderPlaced": ("shipping",)})
    # A publisher that takes a moment per batch so the two relays really overlap
    pub = InMemoryPublisher(before_publish=lambda msgs: time.sleep(0.005))
    barrier = threading.Barrier(2)
    results: dict[str, list[BatchResult]] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def relay(name: str) -> None:
        try:
            barrier.wait()
            while True:
                with pg_sessions() as s:
                    r = dispatch_with_settings(s, pub, clock, settings, tables=tables)
                results[name].append(r)
                if r.claimed == 0:
                    return
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=relay, args=(n,)) for n in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    # Then every row was published, each exactly once (SKIP LOCKED: disjoint claims), and both worked
    per_relay = {n: sum(r.published for r in rs) for n, rs in results.items()}
    duplicates = pub.duplicates()
    print(f"two relays: published per relay {per_relay}, duplicates {duplicates}")
    assert set(pub.message_ids()) == ids and pending(pg_sessions, tables) == 0
    assert sum(per_relay.values()) == 600
    assert duplicates == 0 and sum(r.already_published for rs in results.values() for r in rs) == 0
    assert min(per_relay.values()) > 0


def test_skip_locked_claim_is_held_until_the_mark_commits(pg_sessions: sessionmaker[Session], pg_url: str,
                                                         tmp_path: Path, clock: ManualClock, tables: Tables) -> None:
    # Given a relay paused inside its publish (rows claimed, not yet marked)
    insert(pg_sessions, clock.now_ms(), 3, tables)
    settings = Settings(home=tmp_path, database_url=pg_url, namespace="hold")
    inside, release = threading.Event(), threading.Event()

    def pause(msgs: object) -> None:
        inside.set()
        release.wait(30)

    slow = InMemoryPublisher(before_publish=pause)
    t = threading.Thread(target=lambda: dispatch_with_settings(pg_sessions(), slow, clock, settings, tables=tables))
    t.start()
    try:
        assert inside.wait(30)
        # When a second relay runs meanwhile, then it finds nothing to claim
        with pg_sessions() as s:
            assert dispatch_with_settings(s, InMemoryPublisher(), clock, settings, tables=tables).claimed == 0
    finally:
        release.set()
        t.join(30)
    assert pending(pg_sessions, tables) == 0


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_notify_wakes_the_waiting_loop_before_the_poll_interval(pg_sessions: sessionmaker[Session], pg_url: str,
                                                               tmp_path: Path, tables: Tables, driver: str) -> None:
    # Given the standalone loop idle, polling only once an hour, LISTENing on outbox_pending, on an engine of
    # either driver (a plain create_engine("postgresql://...") picks psycopg 3 on SQLAlchemy 2.1)
    settings = Settings(home=tmp_path, database_url=pg_url, namespace="wake", relay_poll_interval_s=3600.0)
    pub = InMemoryPublisher()
    engine = sa.create_engine(sa.make_url(pg_url).set(drivername=f"postgresql+{driver}"))
    sessions = sessionmaker(bind=engine)
    loop = RelayLoop(settings=settings, tables=tables, session_factory=sessions, publisher=pub,
                     clock=SystemClock())
    thread = threading.Thread(target=loop.run, kwargs={"handle_signals": False})
    thread.start()
    try:
        wait_for(lambda: loop.stats.listening and loop.stats.waits >= 1, "the loop to wait")
        # When a row is inserted (the trigger NOTIFYs)
        ids = insert(pg_sessions, SystemClock().now_ms(), 1, tables)
        # Then the loop publishes it, woken by the notification, not by the hour-long poll
        wait_for(lambda: set(pub.message_ids()) == ids, "the row to be published")
        assert loop.stats.notify_wakeups >= 1
        assert loop.stats.poll_wakeups == 0 and loop.stats.kick_wakeups == 0
        assert loop.stats.errors == 0
    finally:
        loop.stop()
        thread.join(30)
        loop.close()
        engine.dispose()
    assert not thread.is_alive()
