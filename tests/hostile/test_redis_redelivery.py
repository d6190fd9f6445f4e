"""Redis: a message held by a worker killed whole comes back within the visibility timeout + slack.

kombu's Redis transport keeps a taken message in its "unacked" set, stamped with the time the worker
took it, and live workers put back what is older than ``visibility_timeout``. With kombu's defaults
they look only every 10 s x 10 = 100 s, so "redelivered after the visibility timeout" came up to 100 s
late (and up to 10 minutes late with the old interval of a third of the timeout); only the
reconciler, 10 minutes after publishing and under beat alone, caught it. ``redis_transport_options``
now scans every ``unacked_restore_interval`` (a tenth of the timeout, 1 to 30 s) with no throttle,
and the restore mutex expires after one interval: the documented bound is ``visibility_timeout +
2 x interval`` after the dead worker took the message, plus the time the next worker takes to commit
the effect (docs/chaos.md, "What the chaos runs taught us").

These tests run real ``celery -A relay.app worker`` processes against a redis-server of their own
(``--appendonly yes --appendfsync always``, like ``chaos/broker.py``) and real Postgres. The message is
published straight to the broker, as the relay would: there is no outbox row, no beat and no relay,
so the reconciler cannot be what delivers it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from kombu import Connection, Exchange, Producer, Queue

from celery_outbox import Tables
from celery_outbox.celery.config import redis_transport_options
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.messages import Envelope, celery_task_message
from celeryconfig import Settings
from chaos.broker import RedisBroker
from consumers.models import Shipment
from consumers.testing import order_placed_envelope
from devtools.processes import Child, celery_argv, settings_env, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.workers, pytest.mark.chaos, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
CONSUMER = "shipping"
VISIBILITY_TIMEOUT_S = 10
# What the next worker needs to take a restored message and commit its effect (a Postgres transaction
# in a prefork child). Measured here: well under a second; the allowance absorbs a loaded CI machine.
EFFECT_ALLOWANCE_S = 3.0


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisBroker]:
    broker = RedisBroker(data_dir=tmp_path / "redis")
    broker.start()
    try:
        yield broker
    finally:
        broker.kill()


@pytest.fixture
def settings(tmp_path: Path, pg_url: str, own_redis: RedisBroker, namespace: str) -> Settings:
    home = tmp_path / "home"
    home.mkdir()
    # A short visibility timeout; every setting tied to it must stay below it (retry countdown, task
    # time limit) or above it (the reconciler's delay), as Settings validates.
    return Settings(home=home, database_url=pg_url, broker_url=own_redis.url, namespace=namespace,
                    broker_visibility_timeout_s=VISIBILITY_TIMEOUT_S, consumer_retry_backoff_s=1,
                    consumer_retry_backoff_max_s=2, consumer_time_limit_s=5, consumer_max_deliveries=3,
                    relay_reconcile_after_ms=3_600_000)


def start_worker(settings: Settings, log_dir: Path, *, name: str, pool: str, crash_points: str = "") -> Child:
    argv = celery_argv("worker", "-Q", settings.queue_name(CONSUMER), "-P", pool, "-c", "1" if pool == "solo" else "2",
                       "--without-gossip", "--without-mingle", "--without-heartbeat", "-n", f"{name}@%h", "-l", "INFO")
    env = settings_env(settings.replace(crash_points=crash_points), broker_url=settings.broker_url)
    child = Child(name=name, argv=argv, env=env, log_path=log_dir / f"{name}.log", cwd=ROOT).start()
    if not wait_until(lambda: not child.alive or "ready." in child.log_tail(200), timeout_s=60):
        pytest.fail(f"{name} did not start\n{child.log_tail()}")
    assert child.alive, f"{name} exited at start\n{child.log_tail()}"
    return child


def publish(settings: Settings, envelope: Envelope) -> None:
    """Publish as the relay does; the queue is declared first (Redis drops a message nobody is bound for)."""
    exchange = Exchange(settings.exchange_name, type="direct", durable=True)
    queue_name = settings.queue_name(CONSUMER)
    with Connection(settings.broker_url) as conn:
        channel = conn.channel()
        Queue(queue_name, exchange, routing_key=queue_name, durable=True)(channel).declare()
        msg = celery_task_message(envelope, consumer=CONSUMER, routing_key=queue_name)
        Producer(channel, exchange=exchange).publish(
            msg.body, routing_key=msg.routing_key, headers=msg.headers, content_type="application/json",
            content_encoding="utf-8", delivery_mode=2, **msg.properties)


def unacked_taken_at(client: redis.Redis, message_id: str) -> float | None:
    """When a worker took ``message_id`` (kombu's unacked index score), or None if it is not unacked."""
    for tag, raw in client.hgetall("unacked").items():
        payload, _exchange, _routing_key = json.loads(raw)
        if payload["headers"].get("outbox_message_id") == message_id:
            score = client.zscore("unacked_index", tag)
            return None if score is None else float(score)
    return None


def test_the_transport_options_scan_every_interval_with_no_throttle() -> None:
    # Given the default visibility timeout and a short one
    for vt, interval in ((300, 30), (VISIBILITY_TIMEOUT_S, 1), (3, 1), (3600, 30)):
        settings = Settings(broker_visibility_timeout_s=vt, consumer_retry_backoff_max_s=min(60, vt - 1),
                            consumer_time_limit_s=min(120, vt - 1), relay_reconcile_after_ms=max(600_000, vt * 1000 + 1))
        # When the Redis transport options are built
        opts = redis_transport_options(settings)
        # Then every live worker scans for a dead worker's messages every interval (no 10x throttle),
        # and a worker killed while holding the scan mutex blocks scans for one interval at most
        assert opts == {"visibility_timeout": vt, "unacked_restore_interval": interval,
                        "unacked_restore_throttle": 1, "unacked_mutex_expire": interval}


def test_the_installed_kombu_reads_the_restore_options() -> None:
    # Given the installed kombu's Redis channel (kombu < 5.7 ignores these names: 100 s between scans)
    from kombu.transport.redis import Channel

    # Then it reads every option redis_transport_options sets
    known = set(Channel.from_transport_options)
    assert set(redis_transport_options(Settings())) <= known


def test_a_worker_killed_whole_mid_message_is_redelivered_within_the_visibility_timeout(
        settings: Settings, own_redis: RedisBroker, tables: Tables, tmp_path: Path) -> None:
    sessions = make_session_factory(make_engine(settings.effective_database_url))
    client = redis.Redis.from_url(settings.broker_url)
    workers: list[Child] = []
    interval = redis_transport_options(settings)["unacked_restore_interval"]
    bound_s = VISIBILITY_TIMEOUT_S + 2 * interval + EFFECT_ALLOWANCE_S
    try:
        # Given a worker (solo pool: the consumer and the task are one process) armed to SIGKILL itself
        # inside the consumer's transaction, before the commit: the whole worker dies mid-message
        doomed = start_worker(settings, tmp_path, name="doomed", pool="solo", crash_points="consumer_before_commit")
        workers.append(doomed)
        envelope = order_placed_envelope(f"o-{uuid.uuid4().hex[:8]}", message_id=uuid.uuid4())
        message_id = str(envelope.message_id)
        # When an OrderPlaced message reaches it
        publish(settings, envelope)
        assert wait_until(lambda: not doomed.alive, timeout_s=60), f"the crash point never fired\n{doomed.log_tail()}"
        assert doomed.proc is not None and doomed.proc.returncode == -9, doomed.log_tail()
        # Then the message is left unacked in Redis, stamped with the time the dead worker took it
        taken_at = unacked_taken_at(client, message_id)
        assert taken_at is not None, "the message is not in kombu's unacked set"
        with sessions() as s:
            assert s.scalar(sa.select(sa.func.count()).select_from(Shipment)) == 0

        # When a fresh worker (the deployment's prefork pool, no crash point) starts; no beat, no relay
        workers.append(start_worker(settings, tmp_path, name="fresh", pool="prefork"))

        def effect() -> tuple[int, int]:
            with sessions() as s:
                shipments = s.scalar(sa.select(sa.func.count()).select_from(Shipment)
                                     .where(Shipment.order_id == envelope.payload["order_id"]))
                inbox = s.scalar(sa.select(sa.func.count()).select_from(tables.inbox)
                                 .where(tables.inbox.message_id == envelope.message_id))
            return int(shipments or 0), int(inbox or 0)

        # Then the message takes effect within the documented bound after the dead worker took it
        remaining = taken_at + bound_s - time.time()
        redelivered = wait_until(lambda: effect() == (1, 1), timeout_s=max(0.0, remaining), interval_s=0.1)
        state = effect()
        took = time.time() - taken_at
        assert redelivered, (
            f"not redelivered within visibility timeout {VISIBILITY_TIMEOUT_S} s + 2 x {interval} s "
            f"+ {EFFECT_ALLOWANCE_S} s ({took:.1f} s after it was taken; shipments, inbox rows: {state})\n"
            f"--- fresh worker ---\n{workers[-1].log_tail()}")
        print(f"redelivered and committed {took:.2f} s after the dead worker took it "
              f"(visibility timeout {VISIBILITY_TIMEOUT_S} s, restore interval {interval} s)")
        # And exactly once, with nothing left unacked and nothing the reconciler could have re-sent
        assert effect() == (1, 1)
        assert unacked_taken_at(client, message_id) is None
        with sessions() as s:
            assert s.scalar(sa.select(sa.func.count()).select_from(tables.outbox)) == 0
            assert s.scalar(sa.select(sa.func.count()).select_from(tables.dead_letters)) == 0
        assert workers[-1].alive, workers[-1].log_tail()
    finally:
        for w in workers:
            w.stop()
        client.close()
        sessions.kw["bind"].dispose()

