"""A database that stops answering without closing the connection (firewall drop, failover without RST)
freezes no consumer: connect/statement/idle-in-transaction timeouts end what the server or libpq can end,
the consumer task's hard time limit ends a call stuck on a dead socket, and the killed delivery is
requeued, counted and redelivered. Real ``celery -A relay.app worker`` processes (prefork), real
Postgres behind ``tests.support.blackhole_proxy``, real Redis and RabbitMQ."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Settings as OutboxSettings
from celery_outbox import Tables
from celery_outbox.clock import SystemClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.messages import Envelope
from celeryconfig import Settings
from consumers.effects import effect_counts
from consumers.models import Invoice, SearchDocument, Shipment
from consumers.testing import order_placed_envelope
from tests.integration.test_consumer_worker import CONSUMERS, Worker, cleanup, declare, publish
from tests.outbox_rows import insert_pending
from tests.support import workers as worker_procs
from tests.support.blackhole_proxy import BlackholeProxy

pytestmark = [pytest.mark.postgres, pytest.mark.workers, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]

StartWorker = Callable[[str, dict[str, str]], Worker]


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url


@pytest.fixture
def start_worker(broker_url: str, namespace: str, tmp_path: Path) -> Iterator[StartWorker]:
    """Start one prefork worker (2 children) on every consumer queue, with ``OUTBOX_*`` overrides."""
    started: list[Worker] = []

    def start(database_url: str, overrides: dict[str, str]) -> Worker:
        home = tmp_path / "home"
        home.mkdir(exist_ok=True)
        env = {**os.environ, "OUTBOX_DATABASE_URL": database_url, "OUTBOX_BROKER_URL": broker_url,
               "OUTBOX_NAMESPACE": namespace, "OUTBOX_HOME": str(home), "OUTBOX_CONSUMER_RETRY_BACKOFF_S": "1",
               "OUTBOX_CONSUMER_RETRY_BACKOFF_MAX_S": "2", **overrides}
        env.pop("OUTBOX_CRASH_POINTS", None)
        settings = Settings.from_env({k: v for k, v in env.items() if k.startswith("OUTBOX_")})
        declare(settings, broker_url)  # nothing published before the worker is up is dropped (Redis)
        log = tmp_path / f"worker-{len(started)}.log"
        proc = worker_procs.start_worker(env=env, queues=[settings.queue_name(c) for c in CONSUMERS],
                            node=f"blackhole-{namespace}-{len(started)}@%h", log=log)
        worker = Worker(settings=settings, broker_url=broker_url, log=log, proc=proc)
        started.append(worker)
        return worker

    yield start
    for w in started:
        worker_procs.stop_worker(w.proc)
        cleanup(w.settings, broker_url)


def wait_until(what: str, predicate: Callable[[Session], tuple[bool, object]], worker: Worker,
               sessions: sessionmaker[Session], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        with sessions() as s:
            ok, last = predicate(s)
        if ok:
            return
        if worker.proc.poll() is not None:
            pytest.fail(f"worker exited with {worker.proc.returncode} while waiting for {what}\n{worker.logs()}")
        time.sleep(0.25)
    pytest.fail(f"timed out waiting for {what}; last state {last!r}\n--- worker log ---\n{worker.logs()}")


def consumer_effects(s: Session) -> dict[str, int]:
    """The effects of the consumers this worker runs (the e-mail is a task the relay would send: not here)."""
    counts = effect_counts(s)
    return {c: counts[c] for c in CONSUMERS}


def _fan_out(orders: list[Envelope]) -> list[tuple[Envelope, str]]:
    return [(env, c) for env in orders for c in CONSUMERS]


def _once_each(s: Session, order_ids: list[str]) -> dict[str, list[str]]:
    """Per effect table, the order ids that do not have exactly one row."""
    wrong: dict[str, list[str]] = {}
    for name, column in (("shipping", Shipment.order_id), ("billing", Invoice.order_id),
                         ("search", SearchDocument.order_id)):
        rows = s.execute(sa.select(column, sa.func.count()).group_by(column)).all()
        counts = {str(k): int(n) for k, n in rows}
        bad = [o for o in order_ids if counts.get(o) != 1] + [k for k in counts if k not in order_ids]
        if bad:
            wrong[name] = bad
    return wrong


def test_a_blackholed_database_freezes_no_consumer_and_every_message_takes_effect_once(
        start_worker: StartWorker, pg_url: str, tables: Tables) -> None:
    direct = make_session_factory(make_engine(pg_url))
    parsed = sa.engine.make_url(pg_url)
    with BlackholeProxy(parsed.host or "127.0.0.1", parsed.port or 5432) as proxy:
        proxied = parsed.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        # Given a worker whose database goes through a proxy, with short timeouts and time limit
        worker = start_worker(proxied, {
            "OUTBOX_DB_CONNECT_TIMEOUT_S": "2", "OUTBOX_DB_STATEMENT_TIMEOUT_MS": "2000",
            "OUTBOX_DB_IDLE_IN_TRANSACTION_TIMEOUT_MS": "3000", "OUTBOX_DB_KEEPALIVES_IDLE_S": "1",
            "OUTBOX_DB_KEEPALIVES_INTERVAL_S": "1", "OUTBOX_DB_KEEPALIVES_COUNT": "2",
            "OUTBOX_CONSUMER_TIME_LIMIT_S": "5", "OUTBOX_CONSUMER_MAX_DELIVERIES": "10",
        })
        settings, url = worker.settings, worker.broker_url
        before = [order_placed_envelope(f"before-{i}") for i in range(3)]
        during = [order_placed_envelope(f"during-{i}") for i in range(4)]
        after = [order_placed_envelope(f"after-{i}") for i in range(2)]
        # And messages already processed, so both pool processes hold pooled connections
        publish(settings, url, _fan_out(before))
        wait_until("the first orders", lambda s: (consumer_effects(s) == dict.fromkeys(CONSUMERS, 3), consumer_effects(s)),
                   worker, direct)

        # When the database stops answering without closing anything (old connections stay dead for good)
        proxy.blackhole()
        # And orders arrive during the outage, which lasts longer than every timeout and the time limit
        publish(settings, url, _fan_out(during))
        time.sleep(15)
        with direct() as s:
            # (the outage was real: nothing of it reached the database)
            assert consumer_effects(s) == dict.fromkeys(CONSUMERS, 3), worker.logs()
        assert worker.proc.poll() is None, worker.logs()
        # And the database comes back (new connections only), with more orders behind
        proxy.restore()
        publish(settings, url, _fan_out(after))

        # Then every order takes effect, each exactly once, in every consumer
        ids = [str(e.payload["order_id"]) for e in before + during + after]
        n = len(ids)
        wait_until("every order in every consumer",
                   lambda s: (consumer_effects(s) == dict.fromkeys(CONSUMERS, n), consumer_effects(s)), worker, direct)
        with direct() as s:
            assert _once_each(s, ids) == {}
            assert s.execute(sa.select(sa.func.count()).select_from(tables.inbox)).scalar_one() == n * len(CONSUMERS)
            # And nothing was dead-lettered by the outage
            assert s.execute(sa.select(tables.dead_letters.consumer)).all() == []
        # And the worker is alive, its frozen deliveries having been ended by the time limit
        assert worker.proc.poll() is None, worker.logs()
        assert proxy.swallowed > 0
        assert "Hard time limit (5.0s) exceeded" in worker.log.read_text(errors="replace"), worker.logs()
    direct.kw["bind"].dispose()


def test_a_delivery_killed_by_its_time_limit_is_requeued_counted_and_dead_lettered_at_the_maximum(
        start_worker: StartWorker, pg_url: str, tables: Tables) -> None:
    # Given a worker with a 3 s consumer time limit, 2 deliveries at most, and a statement timeout longer
    # than the time limit (so only the time limit can end the wait below)
    worker = start_worker(pg_url, {"OUTBOX_CONSUMER_TIME_LIMIT_S": "3", "OUTBOX_CONSUMER_MAX_DELIVERIES": "2",
                                   "OUTBOX_DB_STATEMENT_TIMEOUT_MS": "120000"})
    settings, url = worker.settings, worker.broker_url
    holder_engine = make_engine(pg_url, settings=OutboxSettings(db_idle_in_transaction_timeout_ms=600_000))
    direct = make_session_factory(make_engine(pg_url))
    stuck = order_placed_envelope("stuck", message_id=uuid.uuid4())
    # And a transaction of another client that holds the inbox key of that message for billing, so the
    # delivery blocks inside the database driver, where no Python-level timeout reaches it
    holder = holder_engine.connect()
    tx = holder.begin()
    holder.execute(sa.insert(tables.inbox).values(message_id=stuck.message_id, consumer="billing",
                                                  type=stuck.type, processed_at_ms=1))
    try:
        # When the message is delivered to billing
        publish(settings, url, [(stuck, "billing")])

        # Then the first delivery is killed by the time limit and not acked: the message comes back,
        # each lost delivery is counted, and at the maximum it goes to the dead-letter store
        dl = tables.dead_letters

        def dead_lettered(s: Session) -> tuple[bool, object]:
            rows = s.execute(sa.select(dl.consumer, dl.message_id, dl.delivery_count, dl.last_error)).all()
            return len(rows) == 1, rows

        wait_until("the stuck delivery in the dead-letter store", dead_lettered, worker, direct)
        with direct() as s:
            [(consumer, message_id, count, error)] = s.execute(
                sa.select(dl.consumer, dl.message_id, dl.delivery_count, dl.last_error)).all()
        assert (consumer, message_id, count) == ("billing", str(stuck.message_id), 2)
        assert "worker was lost" in error
        assert "Hard time limit (3.0s) exceeded" in worker.log.read_text(errors="replace")
    finally:
        tx.rollback()
        holder.close()
        holder_engine.dispose()
    # And the worker is alive and the messages behind flow
    after = order_placed_envelope("after-stuck")
    publish(settings, url, [(after, "billing")])
    wait_until("the next billing effect", lambda s: (effect_counts(s)["billing"] == 1, effect_counts(s)), worker, direct)
    assert worker.proc.poll() is None, worker.logs()
    direct.kw["bind"].dispose()


# -- the standalone relay (``outbox relay``) behind a silent database ---------------------------------

RELAY_TIMEOUTS = {
    # every bound the relay's watchdog derives its stall bound from, short (relay/loop.py, stall_bound_s)
    "OUTBOX_DB_CONNECT_TIMEOUT_S": "2", "OUTBOX_DB_STATEMENT_TIMEOUT_MS": "2000",
    "OUTBOX_DB_IDLE_IN_TRANSACTION_TIMEOUT_MS": "3000", "OUTBOX_DB_KEEPALIVES_IDLE_S": "1",
    "OUTBOX_DB_KEEPALIVES_INTERVAL_S": "1", "OUTBOX_DB_KEEPALIVES_COUNT": "2", "OUTBOX_RELAY_PUBLISH_TIMEOUT_S": "2",
    "OUTBOX_RELAY_POLL_INTERVAL_S": "0.2",
}


class RelayProcess:
    """A real ``outbox relay`` of the reference deployment, its database through ``proxy``, on Redis."""

    def __init__(self, *, database_url: str, redis_url: str, namespace: str, tmp_path: Path) -> None:
        home = tmp_path / "home"
        home.mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env.update({"OUTBOX_DATABASE_URL": database_url, "OUTBOX_BROKER_URL": redis_url,
                    "OUTBOX_NAMESPACE": namespace, "OUTBOX_HOME": str(home), "OUTBOX_APP": "relay.app",
                    **RELAY_TIMEOUTS})
        self.settings = Settings.from_env({k: v for k, v in env.items() if k.startswith("OUTBOX_")})
        self.log = tmp_path / "relay.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([str(Path(sys.executable).parent / "outbox"), "relay"], cwd=ROOT, env=env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def wait_for(self, what: str, cond: Callable[[], bool], timeout_s: float = 120) -> float:
        """Seconds until ``cond()`` held (fails the test with the relay's log after ``timeout_s``)."""
        start = time.monotonic()
        while not cond():
            if self.proc.poll() is not None:
                pytest.fail(f"relay exited with {self.proc.returncode} while waiting for {what}\n{self.logs()}")
            if time.monotonic() - start > timeout_s:
                pytest.fail(f"timed out waiting for {what}\n--- relay log ---\n{self.logs()}")
            time.sleep(0.05)
        return time.monotonic() - start

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture
def relay_through_proxy(pg_url: str, redis_url: str, namespace: str,
                        tmp_path: Path) -> Iterator[tuple[RelayProcess, BlackholeProxy]]:
    parsed = sa.engine.make_url(pg_url)
    with BlackholeProxy(parsed.host or "127.0.0.1", parsed.port or 5432) as proxy:
        proxied = parsed.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        relay = RelayProcess(database_url=proxied, redis_url=redis_url, namespace=namespace, tmp_path=tmp_path)
        try:
            yield relay, proxy
        finally:
            relay.kill()
            client = redis.Redis.from_url(redis_url)
            keys = [*client.scan_iter(f"{namespace}*"), *client.scan_iter(f"_kombu.binding.{namespace}*")]
            if keys:
                client.delete(*keys)


def _insert(sessions: sessionmaker[Session], tables: Tables, n: int) -> set[str]:
    return {str(m) for m in insert_pending(sessions, SystemClock().now_ms(), n, tables=tables)}


def _pending(sessions: sessionmaker[Session], tables: Tables) -> set[str]:
    o = tables.outbox
    with sessions() as s:
        return {str(m) for m in s.scalars(sa.select(o.message_id).where(o.published_at_ms.is_(None)))}


def _on_queue(redis_url: str, queue: str) -> list[str]:
    """The message ids waiting on a Redis queue (one Celery message per row and consumer)."""
    client = redis.Redis.from_url(redis_url)
    return [json.loads(raw)["headers"]["outbox_message_id"] for raw in client.lrange(queue, 0, -1)]


def test_a_relay_behind_a_silent_database_says_it_is_stalled_and_stops_on_sigterm_at_once(
        relay_through_proxy: tuple[RelayProcess, BlackholeProxy], pg_sessions: sessionmaker[Session],
        tables: Tables, redis_url: str) -> None:
    relay, proxy = relay_through_proxy
    queue = relay.settings.queue_name("shipping")
    # Given a standalone relay publishing through the proxy
    before = _insert(pg_sessions, tables, 3)
    relay.wait_for("the first rows published", lambda: not _pending(pg_sessions, tables))
    # When the database stops answering without closing anything, and rows keep being written
    proxy.blackhole()
    during = _insert(pg_sessions, tables, 3)
    # Then the relay says it is stalled (its watchdog: no progress within the bound its timeouts give)
    relay.wait_for("the stall in the log", lambda: "relay stalled" in relay.log.read_text(errors="replace"))
    # When SIGTERM arrives while its connections are dead
    relay.proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    try:
        code = relay.proc.wait(timeout=5)  # honoured within a second by design; 5 s leaves room for a loaded box
    except subprocess.TimeoutExpired:
        pytest.fail(f"the relay ignored SIGTERM behind a silent database\n{relay.logs()}")
    took = time.monotonic() - start
    print(f"exit after SIGTERM behind the silent database: {took:.2f}s")
    # Then it exited cleanly at once, and nothing was marked that was not published
    assert code == 0, relay.logs()
    assert "relay loop stopped" in relay.logs()
    assert _pending(pg_sessions, tables) == during, f"took {took:.2f}s"
    assert sorted(_on_queue(redis_url, queue)) == sorted(before)
    assert proxy.swallowed > 0


def test_a_relay_behind_a_silent_database_publishes_again_soon_after_it_comes_back_without_a_restart(
        relay_through_proxy: tuple[RelayProcess, BlackholeProxy], pg_sessions: sessionmaker[Session],
        tables: Tables, redis_url: str) -> None:
    relay, proxy = relay_through_proxy
    queue = relay.settings.queue_name("shipping")
    # Given a standalone relay publishing through the proxy
    before = _insert(pg_sessions, tables, 3)
    relay.wait_for("the first rows published", lambda: not _pending(pg_sessions, tables))
    pid = relay.proc.pid
    # When the database goes silent (old connections dead for good), rows are written meanwhile,
    # and the outage outlasts the relay's stall bound
    proxy.blackhole()
    during = _insert(pg_sessions, tables, 4)
    relay.wait_for("the stall in the log", lambda: "relay stalled" in relay.log.read_text(errors="replace"))
    assert _pending(pg_sessions, tables) == during  # (the outage was real: nothing got through)
    # And the database comes back (new connections only)
    proxy.restore()
    # Then the same process publishes every row written meanwhile, each once, in seconds
    recovery_s = relay.wait_for("the rows written during the outage", lambda: not _pending(pg_sessions, tables))
    print(f"recovery after the database came back: {recovery_s:.2f}s")
    # And rows written after are published too (the loop, its LISTEN and its pool all work again)
    after = _insert(pg_sessions, tables, 2)
    relay.wait_for("the rows written after", lambda: not _pending(pg_sessions, tables))
    assert relay.proc.poll() is None and relay.proc.pid == pid
    assert sorted(_on_queue(redis_url, queue)) == sorted(before | during | after)
