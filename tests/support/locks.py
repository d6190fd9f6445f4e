"""Waiting, in a test, until another Postgres session is blocked on a lock."""

from __future__ import annotations

import threading
import time

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker


def waits_on_a_lock(sessions: sessionmaker[Session], thread: threading.Thread, *, timeout_s: float = 30.0) -> bool:
    """True once one session of the test's database waits on a lock (``thread``'s: the test runs no other);
    False if ``thread`` ended first or ``timeout_s`` passed. Sessions are matched by database, not by
    application name: a session's next transaction may run on another pooled connection than the one it
    named."""
    deadline = time.monotonic() + timeout_s
    with sessions() as watch:
        while True:
            waiting = watch.execute(sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'")).scalar_one()
            watch.rollback()
            if waiting == 1:
                return True
            if not thread.is_alive() or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
