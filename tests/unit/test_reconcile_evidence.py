"""Lost means passed over, not late: the reconciler re-sends a message only on evidence that it is lost.

SQLite, the in-memory publisher (its ``queues`` script what the broker's queues hold) and a manual
clock. A consumer that is behind (a backlog the broker still holds) has its messages re-sent at no age;
one that recorded messages published well after a message has passed it over; a queue that holds no
copy of a message older than the floor has lost it; a broker that cannot be asked is no evidence.
"""

from __future__ import annotations

import json
import logging
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Outbox, counters
from celery_outbox.clock import ManualClock
from celery_outbox.delivery import deliver
from celery_outbox.messages import Envelope, celery_task_messages
from celery_outbox.relay.dispatch import dispatch_batch
from celery_outbox.relay.reconcile import PROBE_FAILURES, ReconcileResult, reconcile
from celery_outbox.schema import Tables
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings
from tests.outbox_rows import insert_pending

ROUTES = {"OrderPlaced": ("shipping",)}
QUEUE = "ns.shipping"
FLOOR = 40_000  # OUTBOX_RELAY_RECONCILE_AFTER_MS
SKEW = 10_000  # the relay's publish timeout
INTERVAL = 5_000  # OUTBOX_RELAY_RECONCILE_INTERVAL_S


def order(i: int, mid: object) -> dict[str, object]:
    return {"order_id": f"o-{uuid.uuid4()}", "customer_id": "c", "email": "a@example.com", "currency": "EUR",
            "total_cents": 1, "lines": [{"sku": "s", "quantity": 1, "unit_price_cents": 1}]}


def run(sessions: sessionmaker[Session], pub: InMemoryPublisher, clock: ManualClock, tables: Tables) -> ReconcileResult:
    with sessions() as s:
        return reconcile(s, pub, clock, tables=tables, routes=ROUTES, namespace="ns", max_message_bytes=100_000,
                         older_than_ms=FLOOR, publish_skew_ms=SKEW)


def publish(sessions: sessionmaker[Session], clock: ManualClock, tables: Tables, n: int = 1) -> list[uuid.UUID]:
    """``n`` OrderPlaced events committed and published now (the relay's own dispatch)."""
    ids = insert_pending(sessions, clock.now_ms(), n, tables=tables, payload=order)
    with sessions() as s:
        dispatch_batch(s, InMemoryPublisher(), clock, tables=tables, batch_size=100, max_attempts=3, base_delay_ms=1000,
                       max_delay_ms=10_000, routes=ROUTES, max_message_bytes=100_000, namespace="ns")
    return ids


def consume(sessions: sessionmaker[Session], outbox: Outbox, settings: Settings, clock: ManualClock, tables: Tables,
            ids: list[uuid.UUID]) -> None:
    """The shipping consumer records ``ids`` now (their effect and inbox row)."""
    with sessions() as s:
        rows = s.execute(sa.select(tables.outbox.message_id, tables.outbox.type, tables.outbox.payload,
                                   tables.outbox.headers, tables.outbox.created_at_ms)
                         .where(tables.outbox.message_id.in_(ids))).all()
    for r in rows:
        envelope = Envelope(message_id=r.message_id, type=r.type, payload=r.payload, headers=dict(r.headers or {}),
                            created_at_ms=r.created_at_ms)
        [message] = celery_task_messages(envelope, targets=[("shipping", QUEUE)], max_bytes=100_000)
        deliver(sessions, outbox.registry["shipping"], json.loads(message.body)[0][0], tables=tables, request_id=None,
                settings=settings, clock=clock, first_delivery=True)


def test_a_backlog_the_consumer_has_not_reached_is_never_sent_again_whatever_its_age(
        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given a reconciler that has run once, and 50 events published while the shipping consumer is stopped:
    # the broker holds them all, waiting
    pub = InMemoryPublisher()
    run(sqlite_sessions, pub, clock, tables)
    clock.advance(1_000)
    publish(sqlite_sessions, clock, tables, 50)
    pub.queues.set(QUEUE, ready=50, unacked=())
    # When the reconciler passes every interval for an hour
    waiting = 0
    for _ in range(3_600_000 // INTERVAL):
        clock.advance(INTERVAL)
        result = run(sqlite_sessions, pub, clock, tables)
        waiting += result.waiting
    # Then it sent nothing: every message was late, none was lost; its window waited at the backlog
    assert pub.published == []
    assert waiting == 3_600_000 // INTERVAL - FLOOR // INTERVAL + 1


def test_a_message_the_consumer_passed_over_is_sent_again_while_its_queue_keeps_flowing(
        settings: Settings, outbox: Outbox, sqlite_sessions: sessionmaker[Session], clock: ManualClock,
        tables: Tables) -> None:
    # Given a reconciler that has run once, and one event lost on the way (the Redis take window):
    # the consumer never gets it
    pub = InMemoryPublisher()
    run(sqlite_sessions, pub, clock, tables)
    clock.advance(1_000)
    [lost] = publish(sqlite_sessions, clock, tables)
    lost_at = clock.now_ms()
    # And a queue that keeps flowing: every interval one more event is published and recorded, and the
    # broker always holds a few waiting (the probe never shows it empty)
    pub.queues.set(QUEUE, ready=3, unacked=())
    resent_at = None
    for _ in range(60):
        clock.advance(INTERVAL)
        consume(sqlite_sessions, outbox, settings, clock, tables, publish(sqlite_sessions, clock, tables))
        result = run(sqlite_sessions, pub, clock, tables)
        if result.republished and resent_at is None:
            resent_at = clock.now_ms()
    # Then the lost event alone was sent again, once, to shipping
    assert [(m.message_id, m.consumer) for m in pub.published] == [(str(lost), "shipping")]
    # And only after the consumer had recorded events published a floor and the publish skew after it was
    # taken, within two such spans and two passes (docs/settings.md states the bound)
    assert resent_at is not None
    assert lost_at + FLOOR + SKEW < resent_at <= lost_at + 2 * (FLOOR + SKEW + INTERVAL) + 2 * INTERVAL


def test_a_consumer_that_has_moved_on_but_not_by_the_margin_does_not_pass_a_message_over(
        settings: Settings, outbox: Outbox, sqlite_sessions: sessionmaker[Session], clock: ManualClock,
        tables: Tables) -> None:
    # Given an event that the consumer has not recorded, and later ones it recorded soon after (a worker
    # holding the first in a retry, or a prefetch taken out of order), a backlog still waiting
    pub = InMemoryPublisher()
    run(sqlite_sessions, pub, clock, tables)
    clock.advance(1_000)
    publish(sqlite_sessions, clock, tables)
    pub.queues.set(QUEUE, ready=10, unacked=())
    clock.advance(1_000)
    consume(sqlite_sessions, outbox, settings, clock, tables, publish(sqlite_sessions, clock, tables, 5))
    # When the reconciler passes for far longer than the floor, the consumer recording nothing newer
    for _ in range(10 * FLOOR // INTERVAL):
        clock.advance(INTERVAL)
        run(sqlite_sessions, pub, clock, tables)
    # Then nothing is sent: the consumer never recorded anything published after it could have given it back
    assert pub.published == []


def test_an_old_message_its_queue_holds_no_copy_of_is_sent_again_and_one_a_worker_holds_is_not(
        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given two events no consumer recorded, older than the floor; the queue is empty, but a worker holds
    # one of them unacknowledged (Redis: kombu's unacked hash; a retry waiting for its countdown)
    pub = InMemoryPublisher()
    run(sqlite_sessions, pub, clock, tables)
    clock.advance(1_000)
    held, lost = publish(sqlite_sessions, clock, tables, 2)
    pub.queues.set(QUEUE, ready=0, unacked=[str(held)])
    # When the reconciler passes before the floor, it sends nothing, and after it the one no worker holds
    clock.advance(FLOOR // 2)
    assert run(sqlite_sessions, pub, clock, tables).republished == 0
    clock.advance(FLOOR)
    assert run(sqlite_sessions, pub, clock, tables).republished == 0  # held comes first: the window waits
    assert pub.published == []
    # Then once the worker lets go of it (and still never recorded it) both are lost, and are sent again
    pub.queues.set(QUEUE, ready=0, unacked=())
    clock.advance(INTERVAL)
    assert run(sqlite_sessions, pub, clock, tables).republished == 2
    assert {m.message_id for m in pub.published} == {str(held), str(lost)}


def test_an_empty_rabbitmq_queue_with_consumers_counts_as_empty_only_after_a_whole_floor(
        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given an event no consumer recorded, older than the floor, on a RabbitMQ queue with nothing waiting and
    # a consumer attached (RabbitMQ cannot say what its consumers hold unacknowledged)
    pub = InMemoryPublisher()
    run(sqlite_sessions, pub, clock, tables)
    clock.advance(1_000)
    [lost] = publish(sqlite_sessions, clock, tables)
    pub.queues.set(QUEUE, ready=0, unacked=None, consumers=1)
    clock.advance(FLOOR + 1)
    # When the reconciler first sees the queue empty, it waits
    assert run(sqlite_sessions, pub, clock, tables).republished == 0
    # And when the queue had a message waiting in between, it starts over
    clock.advance(FLOOR // 2)
    pub.queues.set(QUEUE, ready=1, unacked=None, consumers=1)
    assert run(sqlite_sessions, pub, clock, tables).republished == 0
    pub.queues.set(QUEUE, ready=0, unacked=None, consumers=1)
    clock.advance(FLOOR // 2 + 1)
    assert run(sqlite_sessions, pub, clock, tables).republished == 0
    clock.advance(FLOOR // 2)
    assert run(sqlite_sessions, pub, clock, tables).republished == 0
    # Then after a whole floor of empty asks it is lost and sent again; a queue with no consumer at all
    # holds nothing unacknowledged, so needs no wait
    clock.advance(FLOOR // 2)
    assert run(sqlite_sessions, pub, clock, tables).republished == 1
    assert [m.message_id for m in pub.published] == [str(lost)]


def test_a_broker_that_cannot_be_asked_is_no_evidence_logged_and_counted(
        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given an event no consumer recorded, old, whose queue is in fact empty
    pub = InMemoryPublisher()
    run(sqlite_sessions, pub, clock, tables)
    clock.advance(1_000)
    [lost] = publish(sqlite_sessions, clock, tables)
    clock.advance(10 * FLOOR)
    # When the broker cannot be asked what its queues hold
    pub.queues.fail(1)
    with caplog.at_level(logging.WARNING, "celery_outbox.relay.reconcile"):
        result = run(sqlite_sessions, pub, clock, tables)
    # Then nothing is sent on age alone: the pass says so, logs it and counts it
    assert (result.republished, result.probe_failed, result.waiting) == (0, True, 1)
    assert "cannot ask the broker what its queues hold" in caplog.text
    with sqlite_sessions() as s:
        assert s.scalar(sa.select(tables.counters.value).where(tables.counters.consumer == counters.RELAY,
                                                               tables.counters.name == PROBE_FAILURES)) == 1
    # And the next pass, the broker answering, sends it
    clock.advance(INTERVAL)
    assert run(sqlite_sessions, pub, clock, tables).republished == 1
    assert [m.message_id for m in pub.published] == [str(lost)]


def test_an_empty_rabbitmq_queue_seen_only_at_asks_far_apart_starts_its_wait_over(
        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given an event no consumer recorded, on a RabbitMQ queue with a consumer, seen empty by one pass
    pub = InMemoryPublisher()
    run(sqlite_sessions, pub, clock, tables)
    clock.advance(1_000)
    [lost] = publish(sqlite_sessions, clock, tables)
    pub.queues.set(QUEUE, ready=0, unacked=None, consumers=1)
    clock.advance(FLOOR + 1)
    assert run(sqlite_sessions, pub, clock, tables).republished == 0
    # When no pass asks again for two floors (the relay was down: what the queue held meanwhile is unknown)
    clock.advance(2 * FLOOR)
    # Then the next pass that finds it empty starts the wait over, and only a floor of asks later re-sends
    assert run(sqlite_sessions, pub, clock, tables).republished == 0
    for _ in range(FLOOR // INTERVAL - 1):
        clock.advance(INTERVAL)
        assert run(sqlite_sessions, pub, clock, tables).republished == 0
    clock.advance(INTERVAL)
    assert run(sqlite_sessions, pub, clock, tables).republished == 1
    assert [m.message_id for m in pub.published] == [str(lost)]
