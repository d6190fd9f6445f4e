"""Review of the relay's gather (issue #24): after a NOTIFY the loop waits ``relay_gather_ms`` for more commits
while the commit rate expects them. What happens during that window: a commit's NOTIFY, a broken LISTEN
connection, a kick. None may cost a row, and none may wake the loop again for nothing."""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.clock import ManualClock
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings
from tests.outbox_rows import insert_pending

pytestmark = pytest.mark.postgres


def gathering_loop(tmp_path: Path, pg_url: str, sessions: sessionmaker[Session], clock: ManualClock,
                   tables: Tables) -> RelayLoop:
    """A listening loop whose commit rate expects more commits within its (long) gather window."""
    settings = Settings(home=tmp_path, database_url=pg_url, namespace="rg", routes={"OrderPlaced": ("shipping",)},
                        relay_gather_ms=1_000, relay_poll_interval_s=0.05)
    loop = RelayLoop(settings=settings, tables=tables, session_factory=sessions, publisher=InMemoryPublisher(),
                     clock=clock)
    loop._ensure_listener()
    assert loop._listener is not None
    loop.commit_rate.add(10_000, at=time.monotonic())
    return loop


def notify_arrived(loop: RelayLoop) -> None:
    assert loop._listener is not None
    assert select.select([loop._listener], [], [], 30)[0], "the NOTIFY never arrived"


def during_gather(loop: RelayLoop, action: Callable[[], None]) -> None:
    """Run ``action`` at the start of the loop's next gather (once), then gather as usual."""
    gather = loop._gather
    done: list[bool] = []

    def wrapped() -> None:
        if not done:
            done.append(True)
            action()
        gather()

    loop._gather = wrapped  # type: ignore[method-assign]


def test_a_commit_whose_notify_arrives_during_the_gather_is_claimed_by_the_drain_after_it(
        pg_sessions: sessionmaker[Session], pg_url: str, tmp_path: Path, clock: ManualClock, tables: Tables) -> None:
    loop = gathering_loop(tmp_path, pg_url, pg_sessions, clock, tables)

    def commit_meanwhile() -> None:
        insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables)
        notify_arrived(loop)

    # Given a commit whose NOTIFY wakes the loop, and a second commit whose NOTIFY arrives during the gather
    during_gather(loop, commit_meanwhile)
    insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables)
    notify_arrived(loop)
    loop._wait()
    assert (loop.stats.notify_wakeups, loop.stats.gathers) == (1, 1)
    # When the loop drains after the gather
    # Then it publishes both commits' rows, and the second NOTIFY was dropped by the claim: the next wait
    # ends by the poll, not by a NOTIFY whose row is already published
    assert loop.drain_once().published == 2
    assert loop.stats.coalesced == 1
    loop._wait()
    assert (loop.stats.notify_wakeups, loop.stats.poll_wakeups) == (1, 1)
    loop.close()


def test_a_listen_connection_broken_during_the_gather_costs_no_row_and_listens_again(
        pg_sessions: sessionmaker[Session], pg_url: str, tmp_path: Path, clock: ManualClock, tables: Tables) -> None:
    loop = gathering_loop(tmp_path, pg_url, pg_sessions, clock, tables)
    assert loop._listener is not None
    first_pid = loop._listener.conn.info.backend_pid

    def commit_then_break() -> None:
        insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables)
        with pg_sessions() as s:
            assert s.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": first_pid}).scalar()

    def until(done: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + 30
        while not done() and time.monotonic() < deadline:
            time.sleep(0.02)
        return done()

    def listening_anew() -> bool:
        listener = loop._listener
        return listener is not None and listener.conn.info.backend_pid != first_pid

    # Given a running loop, a commit whose NOTIFY wakes it, and during the gather a second commit and the
    # LISTEN connection terminated by the server
    during_gather(loop, commit_then_break)
    loop.poll_interval_s = 1.0
    runner = threading.Thread(target=loop.run, kwargs={"handle_signals": False}, daemon=True)
    runner.start()
    try:
        # (committed once the loop waits, polling seldom, so its NOTIFY is what wakes it: a drain running
        # meanwhile would claim the row and drop its notification, and nothing would gather)
        assert until(lambda: loop.stats.waits >= 1), loop.stats
        insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables)
        # When the loop goes on, Then both commits' rows are published (the claim does not need their
        # notifications) and it LISTENs again on a new connection
        assert until(lambda: loop.stats.published == 2 and listening_anew()), \
            (loop.stats, loop._listener)
        assert loop.stats.gathers >= 1
        # And a commit after that is published too
        insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables)
        assert until(lambda: loop.stats.published == 3), loop.stats
    finally:
        loop.stop()
        runner.join(30)
    assert not runner.is_alive()
    loop.close()


def test_a_kick_during_the_gather_ends_it_and_does_not_wake_the_next_wait_again(
        pg_sessions: sessionmaker[Session], pg_url: str, tmp_path: Path, clock: ManualClock, tables: Tables) -> None:
    loop = gathering_loop(tmp_path, pg_url, pg_sessions, clock, tables)
    # Given a commit's NOTIFY that woke the loop, and a kick during the gather (it ends the gather at once)
    during_gather(loop, loop.kick)
    insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables)
    notify_arrived(loop)
    loop._wait()
    assert loop.stats.gathers == 1
    assert loop.drain_once().published == 1
    # When the loop waits after the drain that the kick asked for
    # Then the wait ends by the poll: the kick was taken by the gather it ended, not left to end this wait too
    kicks = loop.stats.kick_wakeups
    loop._wait()
    assert (loop.stats.kick_wakeups - kicks, loop.stats.poll_wakeups) == (0, 1)
    loop.close()


def test_a_kick_that_comes_with_a_notify_claims_at_once(
        pg_sessions: sessionmaker[Session], pg_url: str, tmp_path: Path, clock: ManualClock, tables: Tables) -> None:
    loop = gathering_loop(tmp_path, pg_url, pg_sessions, clock, tables)
    # Given a commit's NOTIFY and a kick that arrive together, while the commit rate would gather
    insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables)
    notify_arrived(loop)
    loop.kick()
    # When the loop waits, Then it wakes for both and does not gather: a kick asks for a claim now
    loop._wait()
    assert (loop.stats.notify_wakeups, loop.stats.kick_wakeups, loop.stats.gathers) == (1, 1, 0)
    loop.close()
