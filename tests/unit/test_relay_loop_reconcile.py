"""The standalone relay (``outbox relay``) reconciles on its interval, as beat's reconcile task does."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import counters
from celery_outbox.clock import ManualClock
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.relay.reconcile import event_watermark, reconcile
from celery_outbox.schema import Tables
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings
from tests.outbox_rows import insert_pending

INTERVAL_S = 60.0
AFTER_MS = 600_000
ROUTES = {"OrderPlaced": ("shipping",)}


def make_loop(tmp_path: Path, sqlite_url: str, sessions: sessionmaker[Session], clock: ManualClock,
              tables: Tables, pub: InMemoryPublisher) -> RelayLoop:
    settings = Settings(home=tmp_path, database_url=sqlite_url, namespace="tl", relay_poll_interval_s=0.01,
                        relay_reconcile_interval_s=INTERVAL_S, relay_reconcile_after_ms=AFTER_MS)
    return RelayLoop(settings=settings, tables=tables, session_factory=sessions, publisher=pub, clock=clock,
                     routes=ROUTES, listen=False)


def watermark(sessions: sessionmaker[Session], tables: Tables) -> int | None:
    with sessions() as s:
        value = s.scalar(sa.select(tables.counters.value).where(tables.counters.consumer == counters.RELAY,
                                                                tables.counters.name == event_watermark("shipping")[0]))
    return None if value is None else int(value)


def wait_for(cond: Any, what: str, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_reconcile_runs_at_once_then_once_per_interval(tmp_path: Path, sqlite_url: str,
                                                       sqlite_sessions: sessionmaker[Session],
                                                       clock: ManualClock, tables: Tables) -> None:
    pub = InMemoryPublisher()
    loop = make_loop(tmp_path, sqlite_url, sqlite_sessions, clock, tables, pub)
    # Given a fresh standalone relay: its first check runs a pass at once (which starts the watermark)
    assert loop.reconcile_if_due() is not None
    assert loop.stats.reconciles == 1 and watermark(sqlite_sessions, tables) == clock.now_ms() - AFTER_MS
    # When it is checked again before the interval has passed, nothing runs
    clock.advance(int(INTERVAL_S * 1000) - 1)
    assert loop.reconcile_if_due() is None
    assert loop.stats.reconciles == 1
    # Then the check at the interval runs the next pass, and the one after waits a whole interval again
    clock.advance(1)
    assert loop.reconcile_if_due() is not None
    assert loop.reconcile_if_due() is None
    assert loop.stats.reconciles == 2 and watermark(sqlite_sessions, tables) == clock.now_ms() - AFTER_MS
    loop.close()


def test_a_published_event_no_consumer_recorded_is_sent_again_by_the_standalone_relay(
        tmp_path: Path, sqlite_url: str, sqlite_sessions: sessionmaker[Session], clock: ManualClock,
        tables: Tables) -> None:
    pub = InMemoryPublisher()
    loop = make_loop(tmp_path, sqlite_url, sqlite_sessions, clock, tables, pub)
    loop.reconcile_if_due()  # the watermark starts now
    # Given an event the relay published, whose message the broker then lost (no inbox row ever)
    clock.advance(1_000)
    [mid] = insert_pending(sqlite_sessions, clock.now_ms(), 1, tables=tables)
    assert loop.drain_once().published == 1
    # When the standalone relay checks once the reconciler's delay and one more interval have passed
    clock.advance(AFTER_MS + int(INTERVAL_S * 1000))
    result = loop.reconcile_if_due()
    # Then it publishes that event again, to the consumer that never recorded it, through its own publisher
    assert result is not None and (result.checked, result.republished) == (1, 1)
    assert [(m.properties["message_id"], m.consumer) for m in pub.published] == [(str(mid), "shipping")] * 2
    assert loop.stats.reconciled == 1
    loop.close()


def test_run_reconciles_on_its_interval(tmp_path: Path, sqlite_url: str, sqlite_sessions: sessionmaker[Session],
                                        clock: ManualClock, tables: Tables) -> None:
    pub = InMemoryPublisher()
    loop = make_loop(tmp_path, sqlite_url, sqlite_sessions, clock, tables, pub)
    thread = threading.Thread(target=loop.run, kwargs={"handle_signals": False})
    thread.start()
    try:
        # Given a running standalone relay: it reconciles once at start
        wait_for(lambda: loop.stats.reconciles == 1, "the first reconcile pass")
        # When the (manual) clock passes one interval
        clock.advance(int(INTERVAL_S * 1000))
        # Then it reconciles once more, and not again while the clock stands still, however often it polls
        wait_for(lambda: loop.stats.reconciles == 2, "the reconcile pass one interval later")
        drains = loop.stats.drains
        wait_for(lambda: loop.stats.drains >= drains + 20, "twenty more polls")
    finally:
        loop.stop()
        thread.join(10)
    assert not thread.is_alive()
    assert loop.stats.reconciles == 2 and loop.stats.errors == 0
    assert watermark(sqlite_sessions, tables) == clock.now_ms() - AFTER_MS
    loop.close()


def test_a_failing_reconcile_pass_is_logged_and_retried_an_interval_later(
        tmp_path: Path, sqlite_url: str, sqlite_sessions: sessionmaker[Session], clock: ManualClock,
        tables: Tables, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pub = InMemoryPublisher()
    loop = make_loop(tmp_path, sqlite_url, sqlite_sessions, clock, tables, pub)
    failures = [RuntimeError("database blip")]

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return reconcile(*args, **kwargs)

    # Given a reconcile pass that fails (a database blip)
    monkeypatch.setattr("celery_outbox.relay.loop.reconcile", flaky)
    # When the relay runs it, the loop does not die: the error is logged and counted
    assert loop.reconcile_if_due() is None
    assert loop.stats.errors == 1 and loop.stats.reconciles == 0
    assert "reconcile pass failed" in caplog.text
    # Then it is not retried in a tight loop, but one interval later, and that pass runs
    assert loop.reconcile_if_due() is None and loop.stats.reconciles == 0
    clock.advance(int(INTERVAL_S * 1000))
    assert loop.reconcile_if_due() is not None
    assert loop.stats.reconciles == 1 and watermark(sqlite_sessions, tables) == clock.now_ms() - AFTER_MS
    loop.close()
