"""A real broker outage: our own durable redis-server is stopped mid-run and started again.

Rows written during the outage back off as a relay (the breaker), are never charged or
dead-lettered, and drain by themselves when the broker returns; the messages published before the
outage survive the restart because this server fsyncs its append-only file on every write.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.celery.kombu_publisher import KombuPublisher
from celery_outbox.clock import ManualClock
from celery_outbox.relay.dispatch import breaker_from_settings, dispatch_with_settings
from celeryconfig import Settings
from relay.embedded import free_port
from tests.outbox_rows import insert_pending

pytestmark = [pytest.mark.redis, pytest.mark.slow]


class OwnRedis:
    def __init__(self, data_dir: Path) -> None:
        self.binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.dir = data_dir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--maxmemory-policy", "noeviction",
             "--logfile", str(self.dir / "redis.log")])
        deadline = time.monotonic() + 30
        while True:
            try:
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return
            except redis.exceptions.RedisError:
                pass
            assert time.monotonic() < deadline, (self.dir / "redis.log").read_text()
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.proc = None
        with socket.socket() as s:  # the port is really closed now
            assert s.connect_ex(("127.0.0.1", self.port)) != 0


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    if not (shutil.which("redis-server") or Path("/usr/bin/redis-server").exists()):
        pytest.skip("redis-server binary not installed")
    data = tmp_path / "redis"
    data.mkdir()
    server = OwnRedis(data)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(30)


def insert(sessions: sessionmaker[Session], clock: ManualClock, n: int, tables: Tables) -> set[str]:
    return {str(i) for i in insert_pending(sessions, clock.now_ms(), n, tables=tables, payload=lambda i, mid: {})}


def test_redis_stopped_and_restarted_during_a_run_loses_and_dead_letters_nothing(
        own_redis: OwnRedis, sqlite_sessions: sessionmaker[Session], clock: ManualClock,
        namespace: str, tmp_path: Path, tables: Tables) -> None:
    settings = Settings(home=tmp_path, namespace=namespace, broker_url=own_redis.url, relay_batch_size=5,
                        relay_max_attempts=3, relay_breaker_base_ms=1_000, relay_breaker_max_ms=30_000,
                        routes={"OrderPlaced": ("shipping", "billing")})
    breaker = breaker_from_settings(settings)
    with KombuPublisher(broker_url=own_redis.url, settings=settings, publish_timeout_s=2.0,
                        connect_retries=0) as pub:

        def drain() -> tuple[int, bool]:
            published = 0
            while True:
                with sqlite_sessions() as s:
                    r = dispatch_with_settings(s, pub, clock, settings, tables=tables, breaker=breaker)
                published += r.published
                if r.broker_unavailable or r.claimed == 0:
                    return published, r.broker_unavailable

        # Given a healthy broker that got the first 10 rows
        before = insert(sqlite_sessions, clock, 10, tables)
        assert drain() == (10, False)
        # When the broker goes down and 10 more orders come in
        own_redis.stop()
        during = insert(sqlite_sessions, clock, 10, tables)
        outcomes = []
        for _ in range(6):  # the relay keeps ticking through the outage (fake clock, 10 s a tick)
            outcomes.append(drain())
            clock.advance(10_000)
        # Then every attempt saw the outage, and no row was charged or dead-lettered
        assert outcomes == [(0, True)] * 6
        with sqlite_sessions() as s:
            rows = list(s.scalars(sa.select(tables.outbox).where(tables.outbox.published_at_ms.is_(None))))
        assert len(rows) == 10 and all(r.attempts == 0 and r.dead_lettered_at_ms is None for r in rows)
        # When the broker comes back, then the backlog drains by itself
        own_redis.start()
        clock.advance(breaker.wait_ms(clock.now_ms()))
        published, unavailable = drain()
        assert (published, unavailable) == (10, False)
    # And both the pre-outage and the outage messages are in every queue (AOF kept the former)
    client = redis.Redis.from_url(own_redis.url)
    for consumer in settings.routes["OrderPlaced"]:
        bodies = [json.loads(raw) for raw in client.lrange(settings.queue_name(consumer), 0, -1)]
        ids = {b["headers"]["outbox_message_id"] for b in bodies}
        assert ids == before | during, consumer
