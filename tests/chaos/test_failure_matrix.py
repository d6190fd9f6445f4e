"""One test per failure-matrix row (docs/failure-matrix.md), each provoking the failure in real processes.

The crash rows SIGKILL a real ``outbox relay``, ``celery worker`` or order-writer process at a named
crash point (``OUTBOX_CRASH_POINTS``), restart it, and check the invariants of chaos/invariants.py
on real Postgres. Waiting is polling the database with a deadline, never a timing assertion.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterable

import pytest
import sqlalchemy as sa

from chaos import invariants
from chaos.environment import ChaosEnvironment
from chaos.load import make_plan as plan
from chaos.processes import ManagedProcess
from consumers.models import Shipment
from orders.models import Order

pytestmark = [pytest.mark.chaos, pytest.mark.postgres, pytest.mark.workers, pytest.mark.slow]

KILLED = -signal.SIGKILL
ROWS = 2  # outbox rows per order: its OrderPlaced event and its confirmation e-mail task (orders/tasks.py)


def settle(env: ChaosEnvironment, *, rolled_back: Iterable[str] = (), poison: Iterable[tuple[str, str]] = (),
           min_duplicates: int = 0, timeout_s: float = 90.0) -> invariants.InvariantReport:
    """Wait for quiescence, then check every invariant; fail with the processes' logs."""
    poison = list(poison)

    def done() -> bool:
        with env.sessions() as s:
            return (invariants.quiescent(s, tables=env.tables, consumers=env.consumers,
                                         expected_dead_letters=len(poison))
                    and invariants.duplicates_absorbed(s, tables=env.tables) >= min_duplicates)

    env.wait(done, timeout_s=timeout_s, what="quiescence")
    with env.sessions() as s:
        report = invariants.check(s, tables=env.tables, consumers=env.consumers, rolled_back=rolled_back,
                                  poison=poison, min_duplicates=min_duplicates)
    assert report.ok, f"{report.violations}\n{env.logs()}"
    return report


def place(env: ChaosEnvironment, items: list[dict[str, object]], *, crash: str = "") -> ManagedProcess:
    loader = env.orders(items)
    loader.start(crash_points=crash)
    code = loader.wait_exit(timeout_s=60)
    if not crash:
        assert code == 0, env.logs()
    return loader


def died_by_sigkill(proc: ManagedProcess, env: ChaosEnvironment, *, timeout_s: float = 60.0) -> None:
    code = proc.wait_exit(timeout_s=timeout_s)
    assert code == KILLED, f"{proc.name} exit code {code}, expected SIGKILL\n{env.logs()}"


def test_order_commit_fails_leaves_neither_order_nor_event(redis_chaos: ChaosEnvironment) -> None:
    env = redis_chaos
    # Given: a plan where orders 1 and 3 fail inside their transaction, after their INSERTs
    items = plan(5, rollback=frozenset({1, 3}))
    rolled = [str(items[i]["order_id"]) for i in (1, 3)]
    # When: the real order writer runs it, then relay and worker run
    place(env, items)
    assert env.count(Order) == 3
    assert env.count(env.tables.outbox) == 3 * ROWS
    env.relay().start()
    env.worker().start()
    # Then: exactly the committed orders have effects; the rolled-back ones nothing anywhere
    report = settle(env, rolled_back=rolled)
    assert report.snapshot.committed_orders == 3


def test_crash_after_order_commit_then_relay_publishes(redis_chaos: ChaosEnvironment) -> None:
    env = redis_chaos
    items = plan(4)
    # Given: the order writer SIGKILLs itself right after its 2nd commit
    loader = place(env, items, crash="after_order_commit@2")
    assert loader.sigkills == ["after_order_commit@2"], env.logs()
    # Then: the committed orders are there with their pending rows, nothing was lost with the process
    assert env.count(Order) == 2
    assert env.pending() == 2 * ROWS
    # When: the writer restarts (skipping committed orders), and a relay and worker run
    place(env, items)
    env.relay().start()
    env.worker().start()
    # Then: every order, including the two written just before the kill, has one effect per consumer
    report = settle(env)
    assert report.snapshot.committed_orders == 4


def test_relay_killed_after_claim_before_publish(redis_chaos: ChaosEnvironment) -> None:
    env = redis_chaos
    place(env, plan(5))
    # Given: a relay that dies after claiming (locking) the batch, before publishing it
    relay = env.relay()
    relay.start(crash_points="after_claim_before_publish")
    died_by_sigkill(relay, env)
    # Then: its lock died with its connection; every row is still pending, nothing was sent
    assert env.pending() == 5 * ROWS
    # When: the relay restarts
    relay.start()
    env.worker().start()
    # Then: all published once; nothing had gone out, so no duplicate at all
    report = settle(env)
    assert report.snapshot.duplicates_absorbed == 0


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_relay_killed_after_publish_before_mark_inbox_drops_duplicate(broker: str, request: pytest.FixtureRequest,
                                                                       ) -> None:
    env: ChaosEnvironment = request.getfixturevalue("redis_chaos" if broker == "redis" else "rabbit_chaos")
    place(env, plan(5))
    worker = env.worker()
    worker.start()
    # Given: a relay killed after the broker confirmed the batch, before it marked the rows
    relay = env.relay()
    relay.start(crash_points="after_publish_before_mark")
    died_by_sigkill(relay, env)
    assert env.pending() == 5 * ROWS
    # When: the relay restarts and publishes the same 5 events again
    relay.start()
    # Then: the inbox absorbed one duplicate per (event, consumer) and per e-mail task; each order has
    # exactly one effect per consumer and one confirmation e-mail
    report = settle(env, min_duplicates=5 * len(env.deliveries))
    assert report.snapshot.effects == {c: 5 for c in env.deliveries}


def test_relay_killed_after_mark_loses_nothing(redis_chaos: ChaosEnvironment) -> None:
    env = redis_chaos
    items = plan(6)
    place(env, items[:3])
    # Given: a relay killed right after committing the marks of its first batch
    relay = env.relay()
    relay.start(crash_points="after_mark")
    died_by_sigkill(relay, env)
    assert env.pending() == 0
    # When: more orders arrive and the relay restarts
    place(env, items)
    relay.start()
    env.worker().start()
    # Then: everything published exactly once, no duplicate
    report = settle(env)
    assert report.snapshot.duplicates_absorbed == 0
    assert report.snapshot.committed_orders == 6


def test_broker_down_backlog_drains_nothing_dead_lettered(chaos_env: ChaosEnvironment) -> None:
    env = chaos_env
    relay = env.relay()
    relay.start()
    env.worker().start()
    place(env, plan(2))
    # (consumed too, not just published: on Redis a broker killed while a worker is mid-pop loses that
    # message inside kombu, before any inbox sees it; docs/guarantees.md)
    settle(env)
    # Given: the broker goes away (own Redis SIGKILLed / RabbitMQ proxy cut) during the peak
    env.broker.outage_begin()
    place(env, plan(8))
    # When: the outage lasts far longer than max_attempts x backoff (3 x 200 ms) would allow
    env.wait(lambda: env.count(env.tables.outbox) == 10 * ROWS, what="orders written during the outage")
    time.sleep(4)  # the outage itself: the relay must ride it out (no assertion on time)
    assert relay.alive(), env.logs()
    with env.sessions() as s:
        outbox = env.tables.outbox
        dead = s.execute(sa.select(sa.func.count()).select_from(outbox)
                         .where(outbox.dead_lettered_at_ms.is_not(None))).scalar_one()
        charged = s.execute(sa.select(sa.func.max(outbox.attempts))).scalar_one()
    assert env.pending() == 8 * ROWS
    assert dead == 0
    assert charged == 0  # an unreachable broker is nobody's message's fault (the breaker backs off)
    # Then: the broker returns and the backlog drains by itself; nothing dead-lettered
    env.broker.outage_end()
    report = settle(env)
    assert report.snapshot.committed_orders == 10


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_worker_killed_before_commit_redelivered_processed_once(broker: str, request: pytest.FixtureRequest,
                                                                 ) -> None:
    env: ChaosEnvironment = request.getfixturevalue("redis_chaos" if broker == "redis" else "rabbit_chaos")
    place(env, plan(3))
    env.relay().start()
    env.wait(lambda: env.pending() == 0, what="orders published")
    # Given: a worker that dies in its 2nd delivery, after the effect was flushed, before COMMIT
    worker = env.worker(concurrency=1)  # one delivery at a time: the kill hits exactly one
    worker.start(crash_points="consumer_before_commit@2")
    died_by_sigkill(worker, env)
    # Then: the killed delivery left no effect and no inbox row
    assert env.count(env.tables.inbox) == 1
    # When: the worker restarts
    worker.start()
    # Then: the message is redelivered and processed exactly once
    settle(env, timeout_s=120)


def test_worker_killed_after_commit_before_ack_duplicate_absorbed(redis_chaos: ChaosEnvironment) -> None:
    env = redis_chaos
    place(env, plan(2))
    env.relay().start()
    env.wait(lambda: env.pending() == 0, what="orders published")
    # Given: a worker that commits its first effect and dies before acking the message
    worker = env.worker(concurrency=1)  # one delivery at a time: the kill hits exactly one
    worker.start(crash_points="consumer_after_commit_before_ack")
    died_by_sigkill(worker, env)
    assert env.count(env.tables.inbox) == 1
    # When: the worker restarts, the unacked message comes back
    worker.start()
    # Then: the inbox answers Duplicate; one effect
    settle(env, min_duplicates=1, timeout_s=120)


def test_same_message_delivered_in_parallel_one_effect(redis_chaos: ChaosEnvironment) -> None:
    env = redis_chaos
    place(env, plan(1))
    env.relay().start()
    env.wait(lambda: env.pending() == 0, what="order published")
    # Given: the same event three times on every consumer's queue
    with env.sessions() as s:
        seq = s.execute(sa.select(env.tables.outbox.seq)
                        .where(env.tables.outbox.type == invariants.ORDER_PLACED)).scalar_one()
    injected = env.duplicate(seq, copies=2)
    # When: a 4-thread worker takes the copies at once
    env.worker(pool="threads", concurrency=4).start()
    # Then: one inbox row and one effect per consumer; every extra copy was a Duplicate
    report = settle(env, min_duplicates=injected)
    assert report.snapshot.duplicates_absorbed == injected
    assert env.count(Shipment) == 1


def test_poison_message_dead_lettered_messages_behind_flow(redis_chaos: ChaosEnvironment) -> None:
    env = redis_chaos
    env.worker().start()
    # Given: a poison message at the head of the billing queue, orders behind it
    poison = env.poison(consumer="billing")
    place(env, plan(4))
    env.relay().start()
    # Then: the orders are processed, the poison is dead-lettered after max deliveries, nothing else
    settle(env, poison=[poison])
    with env.sessions() as s:
        row = s.execute(sa.select(env.tables.dead_letters)).scalar_one()
    assert (row.consumer, row.message_id) == poison
    assert row.delivery_count == env.settings.consumer_max_deliveries


def test_two_relays_at_once_inbox_absorbs(redis_chaos: ChaosEnvironment) -> None:
    env = redis_chaos
    # Given: two relays running against the same outbox (two beat schedulers by mistake)
    env.relay("relay-1").start()
    env.relay("relay-2").start()
    env.worker().start()
    # When: orders stream in
    place(env, plan(30))
    # Then: each order has one effect per consumer (SKIP LOCKED keeps double publishes rare)
    report = settle(env)
    assert report.snapshot.committed_orders == 30


def test_slow_consumer_fast_relay_backlog_is_visible_then_drains(redis_chaos: ChaosEnvironment) -> None:
    env = redis_chaos
    # Given: no worker yet, a relay publishing fast
    env.relay().start()
    place(env, plan(12))
    env.wait(lambda: env.pending() == 0, what="orders published")
    # Then: the backlog sits in the broker queues, where queue depth shows it
    depths = env.queue_depths()
    assert depths == {c: 12 for c in env.deliveries}, depths
    # When: the consumer catches up
    env.worker().start()
    settle(env)
    assert env.queue_depths() == {c: 0 for c in env.deliveries}
