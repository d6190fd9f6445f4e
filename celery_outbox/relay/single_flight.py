"""One relay at a time where the database cannot arbitrate: SQLite.

Postgres claims rows with ``FOR UPDATE SKIP LOCKED``, so relays there may overlap freely. SQLite has no
row locks and the relay commits its claim before publishing, so two drains at once (a prefork worker
running two beat ticks, or ``outbox relay`` beside beat) would publish the same rows twice. An
exclusive, non-blocking ``flock`` on a file beside the database makes the second drain skip its turn;
the kernel drops the lock when its holder dies, even by SIGKILL.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def sqlite_lock_path(database_url: str) -> Path | None:
    """The lock file for a SQLite file database; ``None`` where the database arbitrates itself."""
    if not database_url.startswith("sqlite"):
        return None
    path = database_url.split("///", 1)[-1]
    if not path or path == ":memory:":
        return None
    return Path(f"{path}.relay.lock")


@contextlib.contextmanager
def single_flight(lock_path: Path | None) -> Iterator[bool]:
    """Yield True when this process may drain now, False when another drain holds the lock."""
    if lock_path is None:
        yield True
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
