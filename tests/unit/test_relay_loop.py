"""The standalone loop on SQLite: drains until empty, survives errors, stops on SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.relay.loop import RelayLoop, stall_bound_s
from celery_outbox.schema import Tables
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings
from tests.outbox_rows import insert_pending


def insert(sessions: sessionmaker[Session], clock: ManualClock, tables: Tables, n: int) -> set[str]:
    return {str(i) for i in insert_pending(sessions, clock.now_ms(), n, tables=tables, payload=lambda i, mid: {})}

def pending(sessions: sessionmaker[Session], tables: Tables) -> int:
    with sessions() as s:
        return int(s.scalar(sa.select(sa.func.count()).where(tables.outbox.published_at_ms.is_(None))) or 0)


def wait_for(cond: Any, what: str, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def make_settings(tmp_path: Path, sqlite_url: str, *, max_in_flight: int = 10) -> Settings:
    return Settings(home=tmp_path, database_url=sqlite_url, namespace="tl", relay_batch_size=10,
                    relay_max_in_flight_rows=max_in_flight, relay_poll_interval_s=0.05)


def test_drain_once_publishes_batch_after_batch_until_empty(tmp_path: Path, sqlite_url: str,
                                                           sqlite_sessions: sessionmaker[Session],
                                                           clock: ManualClock, tables: Tables) -> None:
    ids = insert(sqlite_sessions, clock, tables, 25)
    pub = InMemoryPublisher()
    loop = RelayLoop(settings=make_settings(tmp_path, sqlite_url), tables=tables, session_factory=sqlite_sessions,
                     publisher=pub, clock=clock)
    result = loop.drain_once()
    assert (result.batches, result.published) == (4, 25)  # 10 + 10 + 5 + the empty one that proves it
    assert set(pub.message_ids()) == ids and pending(sqlite_sessions, tables) == 0
    loop.close()


def test_the_batch_grows_while_batches_come_back_full_and_never_past_the_in_flight_bound(
        tmp_path: Path, sqlite_url: str, sqlite_sessions: sessionmaker[Session], clock: ManualClock,
        tables: Tables) -> None:
    # Given 100 pending rows, batches starting at 10 and at most 40 rows in flight
    ids = insert(sqlite_sessions, clock, tables, 100)
    sizes: list[int] = []
    pub = InMemoryPublisher(before_publish=lambda msgs: sizes.append(len(msgs)))
    settings = make_settings(tmp_path, sqlite_url, max_in_flight=40)
    loop = RelayLoop(settings=settings, tables=tables, session_factory=sqlite_sessions, publisher=pub, clock=clock)
    # When it drains
    result = loop.drain_once()
    # Then the batches doubled while full, capped at 40 rows (one message a row per routed consumer)
    per_row = len(settings.consumers)
    assert sizes == [rows * per_row for rows in (10, 20, 40, 30)]
    assert result.published == 100 and set(pub.message_ids()) == ids
    # And an idle outbox shrinks the batch again: the empty batch that ended the drain halved it
    assert loop.sizer.size == 20
    loop.drain_once()
    assert loop.sizer.size == 10
    loop.close()


def test_drain_once_stops_at_the_first_broker_outage(tmp_path: Path, sqlite_url: str,
                                                     sqlite_sessions: sessionmaker[Session],
                                                     clock: ManualClock, tables: Tables) -> None:
    insert(sqlite_sessions, clock, tables, 25)
    pub = InMemoryPublisher()
    pub.fail_unavailable(5)
    loop = RelayLoop(settings=make_settings(tmp_path, sqlite_url), tables=tables, session_factory=sqlite_sessions,
                     publisher=pub, clock=clock)
    result = loop.drain_once()
    assert result.broker_unavailable and result.batches == 1 and pub.calls == 1
    assert loop.breaker.wait_ms(clock.now_ms()) > 0
    loop.close()


def test_run_logs_errors_and_keeps_going(tmp_path: Path, sqlite_url: str,
                                         sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given a database that fails the first two times the relay opens a session
    ids = insert(sqlite_sessions, clock, tables, 5)
    failures = [RuntimeError("database blip"), RuntimeError("database blip")]

    def flaky() -> Session:
        if failures:
            raise failures.pop()
        return sqlite_sessions()

    flaky.kw = sqlite_sessions.kw  # type: ignore[attr-defined]
    pub = InMemoryPublisher()
    loop = RelayLoop(settings=make_settings(tmp_path, sqlite_url), tables=tables, session_factory=flaky,  # type: ignore[arg-type]
                     publisher=pub, clock=clock)
    thread = threading.Thread(target=loop.run, kwargs={"handle_signals": False})
    thread.start()
    try:
        # Then the loop survives the errors and publishes once the database is back
        wait_for(lambda: pending(sqlite_sessions, tables) == 0, "the backlog to drain")
    finally:
        loop.stop()
        thread.join(10)
    assert not thread.is_alive()
    assert loop.stats.errors == 2
    assert set(pub.message_ids()) == ids
    loop.close()


def test_sigterm_stops_the_loop_cleanly(tmp_path: Path, sqlite_url: str,
                                        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    insert(sqlite_sessions, clock, tables, 3)
    pub = InMemoryPublisher()
    settings = make_settings(tmp_path, sqlite_url).replace(relay_poll_interval_s=3600.0)
    loop = RelayLoop(settings=settings, tables=tables, session_factory=sqlite_sessions, publisher=pub, clock=clock)
    before = signal.getsignal(signal.SIGTERM)

    def terminate() -> None:
        wait_for(lambda: loop.stats.drains >= 1, "the first drain")
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate)
    killer.start()
    loop.run()  # returns only because SIGTERM woke the hour-long wait
    killer.join(10)
    assert loop.stopping and pending(sqlite_sessions, tables) == 0
    assert signal.getsignal(signal.SIGTERM) == before
    loop.close()


def test_the_stall_bound_grows_with_every_timeout_it_is_derived_from(tmp_path: Path, sqlite_url: str) -> None:
    base = make_settings(tmp_path, sqlite_url)
    bound = stall_bound_s(base)
    # Given each timeout a healthy step may take, one at a time made longer
    for change in ({"db_connect_timeout_s": base.db_connect_timeout_s + 5},
                   {"db_statement_timeout_ms": base.db_statement_timeout_ms + 5000},
                   {"relay_publish_timeout_s": base.relay_publish_timeout_s + 5},
                   {"relay_poll_interval_s": base.relay_poll_interval_s + 5}):
        # Then the watchdog waits longer before it calls the loop stalled
        assert stall_bound_s(base.replace(**change)) > bound, change
    # And never less than the longest single step
    assert bound > base.db_connect_timeout_s + base.db_statement_timeout_ms / 1000


class BlockingPublisher(InMemoryPublisher):
    """Blocks inside the first publish until released: a call stuck where no timeout of ours reaches."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        super().__init__(before_publish=self._block)

    def _block(self, _messages: Any) -> None:
        if not self.release.is_set():
            self.entered.set()
            self.release.wait(60)


def fast_settings(tmp_path: Path, sqlite_url: str) -> Settings:
    # the shortest bounds the settings allow: a stall bound of about 3 s
    return make_settings(tmp_path, sqlite_url).replace(db_connect_timeout_s=1, db_statement_timeout_ms=1,
                                                       relay_publish_timeout_s=0.01)


def test_the_watchdog_logs_a_loop_that_makes_no_progress_and_the_loop_goes_on_once_unblocked(
        tmp_path: Path, sqlite_url: str, sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables,
        caplog: pytest.LogCaptureFixture) -> None:
    ids = insert(sqlite_sessions, clock, tables, 3)
    pub = BlockingPublisher()
    loop = RelayLoop(settings=fast_settings(tmp_path, sqlite_url), tables=tables, session_factory=sqlite_sessions,
                     publisher=pub, clock=clock)
    thread = threading.Thread(target=loop.run, kwargs={"handle_signals": False})
    # Given a loop whose publish blocks where no timeout reaches
    with caplog.at_level(logging.ERROR, logger="celery_outbox.relay.loop"):
        thread.start()
        try:
            assert pub.entered.wait(30)
            # Then its watchdog says so once the stall bound has passed without progress
            wait_for(lambda: loop.stats.stalls >= 1, "the watchdog to see the stall")
            assert any("relay stalled" in r.getMessage() for r in caplog.records)
            # When the call returns, the loop goes on and publishes
            pub.release.set()
            wait_for(lambda: pending(sqlite_sessions, tables) == 0, "the backlog to drain")
        finally:
            pub.release.set()
            loop.stop()
            thread.join(10)
    assert not thread.is_alive()
    assert set(pub.message_ids()) == ids
    loop.close()


def test_sigterm_returns_from_run_at_once_even_while_the_loop_is_blocked(
        tmp_path: Path, sqlite_url: str, sqlite_sessions: sessionmaker[Session], clock: ManualClock,
        tables: Tables) -> None:
    insert(sqlite_sessions, clock, tables, 3)
    pub = BlockingPublisher()
    loop = RelayLoop(settings=fast_settings(tmp_path, sqlite_url), tables=tables, session_factory=sqlite_sessions,
                     publisher=pub, clock=clock)
    before = signal.getsignal(signal.SIGTERM)

    def terminate() -> None:
        assert pub.entered.wait(30)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate)
    killer.start()
    try:
        # Given a loop blocked inside a publish, When SIGTERM arrives
        loop.run()
        killer.join(10)
        # Then run returned without waiting for the blocked call, which published nothing and marked nothing
        assert loop.stopping and loop.stats.abandoned
        assert pub.message_ids() == [] and pending(sqlite_sessions, tables) == 3
        assert signal.getsignal(signal.SIGTERM) == before
    finally:
        pub.release.set()  # the abandoned call returns: publish first, then its mark, as ever
    wait_for(lambda: pending(sqlite_sessions, tables) == 0, "the released batch to be marked after its publish")
    assert len(set(pub.message_ids())) == 3
    loop.close()


def test_the_watchdog_sleeps_until_its_deadline_and_a_stop_or_the_loops_end_wakes_it(
        tmp_path: Path, sqlite_url: str, sqlite_sessions: sessionmaker[Session], clock: ManualClock,
        tables: Tables) -> None:
    # Given a loop with the default stall bound (over a minute), polling every 50 ms: progress all the time
    loop = RelayLoop(settings=make_settings(tmp_path, sqlite_url), tables=tables, session_factory=sqlite_sessions,
                     publisher=InMemoryPublisher(), clock=clock, listen=False)
    thread = threading.Thread(target=loop.run, kwargs={"handle_signals": False})
    thread.start()
    try:
        wait_for(lambda: loop.stats.waits >= 10, "ten polls")
    finally:
        # When it is stopped
        loop.stop()
        thread.join(10)
    # Then the stop woke the watchdog and the loop's end let it go at once (not at its deadline, a minute on),
    # and it had not woken in between: it sleeps until its next deadline, not on a tick
    assert not thread.is_alive()
    assert loop.stats.watchdog_wakeups <= 3
    loop.close()


def test_sigterm_wakes_the_watchdog_of_a_blocked_loop_long_before_its_stall_deadline(
        tmp_path: Path, sqlite_url: str, sqlite_sessions: sessionmaker[Session], clock: ManualClock,
        tables: Tables) -> None:
    insert(sqlite_sessions, clock, tables, 3)
    pub = BlockingPublisher()
    # the default stall bound: over a minute
    loop = RelayLoop(settings=make_settings(tmp_path, sqlite_url), tables=tables, session_factory=sqlite_sessions,
                     publisher=pub, clock=clock, listen=False)
    returned = threading.Event()

    def terminate() -> None:
        assert pub.entered.wait(30)
        os.kill(os.getpid(), signal.SIGTERM)
        if not returned.wait(20):  # the watchdog slept through the signal: let the loop finish on its own
            pub.release.set()

    killer = threading.Thread(target=terminate)
    killer.start()
    try:
        # Given a loop blocked inside a publish, When SIGTERM arrives (the main thread's watchdog asleep)
        loop.run()
        returned.set()
        killer.join(10)
        # Then run gave up on the blocked thread after the stop: the signal woke the watchdog
        assert loop.stats.abandoned
    finally:
        pub.release.set()
    wait_for(lambda: pending(sqlite_sessions, tables) == 0, "the released batch to be marked after its publish")
    loop.close()
