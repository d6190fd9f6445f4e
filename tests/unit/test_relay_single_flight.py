"""SQLite cannot arbitrate relays; the single-flight lock makes overlapping drains skip, not double-publish."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.relay.single_flight import single_flight, sqlite_lock_path
from celery_outbox.schema import Tables
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings
from tests.unit.test_relay_loop import insert, pending


def _hold_lock(path: str, ready: multiprocessing.synchronize.Event, release: multiprocessing.synchronize.Event,
               ) -> None:
    with single_flight(Path(path)) as mine:
        assert mine
        ready.set()
        release.wait(30)


def test_a_second_drain_skips_while_another_process_drains(tmp_path: Path, sqlite_url: str,
                                                           sqlite_sessions: sessionmaker[Session],
                                                           clock: ManualClock, tables: Tables) -> None:
    # Given a process that is draining (holds the relay lock of this SQLite database)
    settings = Settings(home=tmp_path, database_url=sqlite_url, namespace="sf", relay_batch_size=10)
    lock = sqlite_lock_path(settings.effective_database_url)
    assert lock is not None
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(lock), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        ids = insert(sqlite_sessions, clock, tables, 5)
        pub = InMemoryPublisher()
        loop = RelayLoop(settings=settings, tables=tables, session_factory=sqlite_sessions, publisher=pub, clock=clock,
                         listen=False)
        # When this relay drains at the same time
        result = loop.drain_once()
        # Then it publishes nothing (no double publish) and says it skipped
        assert result.published == 0 and pub.published == [] and loop.stats.skipped_busy == 1
        assert pending(sqlite_sessions, tables) == 5
    finally:
        release.set()
        holder.join(30)
    # And once the other drain is over, it publishes every row once
    result = loop.drain_once()
    assert result.published == 5 and set(pub.message_ids()) == ids and pending(sqlite_sessions, tables) == 0
    loop.close()


def test_postgres_and_memory_databases_need_no_lock() -> None:
    assert sqlite_lock_path("postgresql://postgres@127.0.0.1/x") is None
    assert sqlite_lock_path("sqlite:///:memory:") is None
    assert sqlite_lock_path("sqlite:////tmp/a.db") == Path("/tmp/a.db.relay.lock")
