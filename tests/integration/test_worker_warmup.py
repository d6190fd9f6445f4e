"""A real prefork worker opens each pool process's database connection as the process starts, before any
message (celery/warmup.py): the first orders after a deploy do not wait for it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_outbox.db import make_engine
from celeryconfig import Settings
from consumers import default_registry
from tests.support.workers import start_worker, stop_worker

pytestmark = [pytest.mark.postgres, pytest.mark.workers, pytest.mark.slow]


def children(pid: int) -> set[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(p) for p in f.read().split()}


def local_tcp_ports(pid: int) -> set[int]:
    """The local ports of ``pid``'s TCP sockets (its fds' socket inodes looked up in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_each_pool_process_holds_a_database_connection_before_its_first_message(
        pg_url: str, rabbitmq_url: str, namespace: str, tmp_path: Path) -> None:
    """Given a prefork worker of the reference deployment, started with nothing queued for it
    When it is ready
    Then each of its pool processes has a Postgres connection open: its first message does not open one"""
    home = tmp_path / "home"
    home.mkdir()
    settings = Settings(home=home, database_url=pg_url, broker_url=rabbitmq_url, namespace=namespace)
    env = {**os.environ, "OUTBOX_DATABASE_URL": pg_url, "OUTBOX_BROKER_URL": rabbitmq_url,
           "OUTBOX_NAMESPACE": namespace, "OUTBOX_HOME": str(home)}
    env.pop("OUTBOX_CRASH_POINTS", None)
    log = tmp_path / "worker.log"
    proc = start_worker(env=env, queues=[settings.queue_name(c) for c in default_registry().names()],
                        node=f"warm-{namespace}@%h", log=log, concurrency=2)
    engine = make_engine(pg_url)
    try:
        deadline = time.monotonic() + 60
        while "ready" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(0.2)
        pool = children(proc.pid)
        assert len(pool) == 2
        unconnected = pool
        while unconnected:
            with engine.connect() as c:
                backends = set(c.exec_driver_sql(
                    "SELECT client_port FROM pg_stat_activity WHERE datname = current_database() "
                    "AND client_port IS NOT NULL AND pid <> pg_backend_pid()").scalars())
            unconnected = {p for p in pool if not (local_tcp_ports(p) & backends)}
            assert time.monotonic() < deadline, (unconnected, log.read_text(errors="replace")[-4000:])
            time.sleep(0.2)
        assert children(proc.pid) == pool  # the same processes: none restarted meanwhile
        with engine.connect() as c:
            taken = c.execute(sa.text("SELECT count(*) FROM outbox_inbox")).scalar_one()
        assert taken == 0  # no message did it
    finally:
        engine.dispose()
        stop_worker(proc)
