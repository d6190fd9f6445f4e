"""The done-when of a message taken and lost: every path comes back through the reconciler, exactly once.

Deterministic, no timing luck: the relay publishes, then the messages are REMOVED from the broker
before any worker takes them (Redis: the queue lists emptied; RabbitMQ: the queues purged, the state
a consumer channel dropped by a killed worker leaves when its messages were already gone), so the
outbox row says "published" and nothing will ever deliver it, exactly the state of a worker SIGKILLed
between kombu's BRPOP and its unacked record. The relay runs in this process on a manual clock, so
"the reconcile window has passed" is a clock move, and the pass is driven directly
(``RelayLoop.reconcile_if_due``, the standalone relay's own call). Real Postgres, real brokers, real
``celery worker`` processes.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from kombu import Connection, Exchange, Queue
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Outbox, Tables
from celery_outbox.celery import relay_tasks
from celery_outbox.clock import ManualClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.inbox.task_keys import task_key
from celery_outbox.ops import stats
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.relay.reconcile import ReconcileResult
from celeryconfig import TASK_QUEUES, Settings
from consumers.effects import effect_counts
from devtools.processes import settings_env
from orders.service import parse_order, place_order
from orders.tasks import NAME as CONFIRMATION
from relay.factory import create_outbox
from tests.support.workers import start_worker, stop_worker
from tests.tasks import idempotent_app as ia

pytestmark = [pytest.mark.postgres, pytest.mark.workers, pytest.mark.slow]

AFTER_MS = 40_000  # the default events window (Settings.relay_reconcile_after_ms)
PLAIN_AFTER_MS = 600_000


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url


def purge(url: str, queues: list[str]) -> int:
    """Remove every message from ``queues`` (no worker has taken them): how many there were."""
    removed = 0
    with Connection(url) as conn:
        channel = conn.channel()
        for name in queues:
            removed += int(Queue(name, no_declare=True)(channel).purge() or 0)
    return removed


def delete_queues(url: str, queues: list[str], exchanges: list[str]) -> None:
    with Connection(url) as conn:
        channel = conn.channel()
        for name in queues:
            Queue(name, no_declare=True)(channel).delete()
        for name in exchanges:
            Exchange(name)(channel).delete()


def wait_for(what: str, observe: Callable[[Session], object], expected: object, sessions: sessionmaker[Session],
             worker: subprocess.Popen[bytes], log: Path, timeout_s: float = 90) -> None:
    """Poll until ``observe`` returns ``expected`` (a wait, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        with sessions() as s:
            last = observe(s)
        if last == expected:
            return
        if worker.poll() is not None:
            break
        time.sleep(0.25)
    pytest.fail(f"waiting for {what}: expected {expected!r}, last {last!r}\n{log.read_text(errors='replace')[-6000:]}")


def relay_of(outbox: Outbox) -> RelayLoop:
    return relay_tasks.relay_loop(outbox, listen=False)


def pass_once_lost(relay: RelayLoop, clock: ManualClock, broker_url: str, windows: int) -> ReconcileResult:
    """The reconcile pass that finds the purged messages lost. Redis lists what its workers hold, so an empty
    queue is proof at once; RabbitMQ cannot, so its queues, empty with a worker attached, count as empty once
    they have stayed so for a whole floor of passes: the first pass then waits at each window (with no consumer attached
    yet, an empty queue holds nothing unacknowledged and is proof at once)."""
    result = relay.reconcile_if_due()
    assert result is not None
    if broker_url.startswith("amqp") and result.republished == 0:
        assert result.waiting == windows
        interval_ms = round(relay.settings.relay_reconcile_interval_s * 1000)
        for _ in range(AFTER_MS // interval_ms):  # a pass per interval, each finding the queues still empty
            clock.advance(interval_ms)
            result = relay.reconcile_if_due()
            assert result is not None
            if result.republished:
                break
    return result


def test_one_order_whose_four_messages_were_taken_and_lost_has_each_effect_once(
        broker_url: str, pg_url: str, namespace: str, tmp_path: Path, tables: Tables) -> None:
    # Given the reference deployment on Postgres and a real broker, its relay on a manual clock, and a
    # reconciler that has run once (its watermark starts now)
    home = tmp_path / "home"
    home.mkdir()
    settings = Settings(home=home, database_url=pg_url, broker_url=broker_url, namespace=namespace)
    clock = ManualClock(start_ms=int(time.time() * 1000))
    engine = make_engine(pg_url)
    sessions = make_session_factory(engine)
    outbox = create_outbox(settings, broker_url=broker_url, session_factory=sessions, clock=clock)
    outbox._tables = tables
    relay = relay_of(outbox)
    # The consumers' queues and the e-mail task's (celeryconfig.TASK_QUEUES)
    queues = [settings.queue_name(c) for c in (*settings.consumers, TASK_QUEUES[CONFIRMATION])]
    worker: subprocess.Popen[bytes] | None = None
    log = tmp_path / "worker.log"
    try:
        assert relay.reconcile_if_due() is not None
        # And one order: its OrderPlaced (shipping, billing, search) and its confirmation e-mail task
        with sessions() as s:
            place_order(s, parse_order({"order_id": "o-lost", "customer_id": "c-1", "email": "a@example.com",
                                        "lines": [{"sku": "s-1", "quantity": 2, "unit_price_cents": 250}]}),
                        outbox=outbox)
        clock.advance(1_000)
        assert relay.drain_once().published == 2  # two outbox rows: the event and the task
        # When all four messages are removed from the broker before any worker took them
        assert purge(broker_url, queues) == 4
        # And a worker starts: nothing arrives (they are gone)
        env = settings_env(settings, broker_url=broker_url)
        env.pop("OUTBOX_CRASH_POINTS", None)
        worker = start_worker(env=env, queues=queues, node=f"reconcile-{namespace}@%h", log=log)
        with sessions() as s:
            assert effect_counts(s) == {"shipping": 0, "billing": 0, "search": 0, "email": 0}
        # Then a reconcile pass before the window ends sends nothing; the first pass after it sends all four
        clock.advance(AFTER_MS // 2)  # (longer than the reconcile interval: the pass's lease is due)
        early = relay.reconcile_if_due()
        assert early is not None and early.republished == 0
        clock.advance(AFTER_MS)
        result = pass_once_lost(relay, clock, broker_url, windows=4)  # three consumers', the tasks'
        assert (result.events, result.tasks, result.plain_tasks) == (3, 1, 0)
        # And every effect exists exactly once: three consumers and one e-mail (the task's inbox row too)
        wait_for("each effect once", effect_counts, {"shipping": 1, "billing": 1, "search": 1, "email": 1},
                 sessions, worker, log)
        with sessions() as s:
            task_rows = s.execute(sa.select(sa.func.count()).select_from(tables.inbox)
                                  .where(tables.inbox.consumer == task_key(CONFIRMATION))).scalar_one()
            assert task_rows == 1
            assert stats.collect(s, tables=tables, clock=clock).reconciled == {
                "total": 4, "events": 3, "tasks": 1, "plain_tasks": 0}
        # And a later pass sends nothing more (each row is checked once)
        clock.advance(AFTER_MS)
        later = relay.reconcile_if_due()
        assert later is not None and later.republished == 0
        with sessions() as s:
            assert effect_counts(s) == {"shipping": 1, "billing": 1, "search": 1, "email": 1}
    finally:
        if worker is not None:
            stop_worker(worker)
        relay.close()
        relay.publisher.close()
        delete_queues(broker_url, queues, [settings.exchange_name])
        outbox.app.close()
        engine.dispose()


@pytest.fixture
def plain_env(broker_url: str, pg_url: str, namespace: str, tmp_path: Path,
              tables: Tables) -> Iterator[tuple[ia.TaskApp, sessionmaker[Session], ManualClock, Settings]]:
    home = tmp_path / "home"
    home.mkdir()
    settings = Settings(home=home, database_url=pg_url, broker_url=broker_url, namespace=namespace, routes={},
                        relay_reconcile_plain_tasks_after_ms=PLAIN_AFTER_MS)
    engine = make_engine(pg_url)
    ia.metadata.create_all(engine)
    sessions = make_session_factory(engine)
    clock = ManualClock(start_ms=int(time.time() * 1000))
    built = ia.build(settings, broker_url=broker_url, session_factory=sessions, clock=clock)
    built.outbox._tables = tables
    try:
        yield built, sessions, clock, settings
    finally:
        delete_queues(broker_url, [ia.tasks_queue(built.settings)], [ia.tasks_queue(built.settings)])
        ia.metadata.drop_all(engine)
        built.app.close()
        engine.dispose()


def test_a_lost_plain_task_is_sent_again_after_its_window_and_one_that_ran_is_not(
        plain_env: tuple[ia.TaskApp, sessionmaker[Session], ManualClock, Settings], broker_url: str,
        tmp_path: Path, tables: Tables) -> None:
    built, sessions, clock, settings = plain_env
    relay = relay_of(built.outbox)
    queue = ia.tasks_queue(built.settings)
    worker: subprocess.Popen[bytes] | None = None
    log = tmp_path / "worker.log"

    def enqueue(key: str) -> str:
        with sessions() as s, built.outbox.transaction(s):
            task_id: str = built.plain.delay(key).id
            s.commit()
        return task_id

    def effects(s: Session) -> dict[str, int]:
        return {k: ia.effect_count(s, ia.PLAIN, k) for k in ("lost", "ran")}

    def has_receipt(task_id: str) -> Callable[[Session], bool]:
        return lambda s: s.get(tables.receipts, uuid.UUID(task_id)) is not None

    try:
        assert relay.reconcile_if_due() is not None  # both watermarks start now
        # Given a plain task published and then removed from the broker before a worker took it
        clock.advance(1_000)
        lost = enqueue("lost")
        assert relay.drain_once().published == 1
        assert purge(broker_url, [queue]) == 1
        # And one published and run by a real worker (which records its receipt)
        ran = enqueue("ran")
        assert relay.drain_once().published == 1
        env = settings_env(settings, broker_url=broker_url)
        env.pop("OUTBOX_CRASH_POINTS", None)
        worker = start_worker(env=env, queues=[queue], node=f"plain-{settings.namespace}@%h", log=log,
                              app="tests.tasks.idempotent_app")
        wait_for("the plain task that was not lost to run", effects, {"lost": 0, "ran": 1}, sessions, worker, log)
        wait_for("its receipt", has_receipt(ran), True, sessions, worker, log)
        # When the events window has passed, neither is sent (a plain task may merely be queued)
        clock.advance(2 * AFTER_MS)
        first = relay.reconcile_if_due()
        assert first is not None and first.republished == 0
        # Then after the plain-task window only the lost one is sent again, and runs once
        clock.advance(PLAIN_AFTER_MS)
        second = pass_once_lost(relay, clock, broker_url, windows=1)
        assert (second.plain_tasks, second.republished) == (1, 1)
        assert [r.message_id for r in second.resent] == [lost]
        wait_for("the lost plain task to run once", effects, {"lost": 1, "ran": 1}, sessions, worker, log)
        wait_for("its receipt", has_receipt(lost), True, sessions, worker, log)
        clock.advance(PLAIN_AFTER_MS)
        third = relay.reconcile_if_due()
        assert third is not None and third.republished == 0
    finally:
        if worker is not None:
            stop_worker(worker)
        relay.close()
        relay.publisher.close()
