"""The reconciler finds (message, consumer) pairs published but never recorded, and sends only those."""

from __future__ import annotations

import json

from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Outbox
from celery_outbox.clock import ManualClock
from celery_outbox.delivery import deliver
from celery_outbox.relay.dispatch import dispatch_batch
from celery_outbox.relay.reconcile import reconcile
from celery_outbox.schema import Tables
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings
from tests.outbox_rows import insert_pending

ROUTES = {"OrderPlaced": ("shipping", "billing")}
AFTER = 600_000


def order(i: int, mid: object) -> dict[str, object]:
    return {"order_id": f"o-{i}", "customer_id": "c", "email": "a@example.com", "currency": "EUR",
            "total_cents": 1, "lines": [{"sku": "s", "quantity": 1, "unit_price_cents": 1}]}


def run(sessions: sessionmaker[Session], pub: InMemoryPublisher, clock: ManualClock, tables: Tables,
        max_pages: int = 100) -> tuple[int, int]:
    with sessions() as s:
        r = reconcile(s, pub, clock, tables=tables, routes=ROUTES, namespace="ns", max_message_bytes=100_000, older_than_ms=AFTER,
                      max_pages=max_pages)
    return r.checked, r.republished


def test_lost_messages_are_sent_again_to_the_consumer_that_missed_them(
        settings: Settings, outbox: Outbox, sqlite_sessions: sessionmaker[Session], clock: ManualClock,
        tables: Tables) -> None:
    # Given a reconciler that has run once (its watermark starts now), and three published events
    relay_pub = InMemoryPublisher()
    assert run(sqlite_sessions, relay_pub, clock, tables) == (0, 0)
    clock.advance(AFTER)
    ids = insert_pending(sqlite_sessions, clock.now_ms(), 3, tables=tables, payload=order)
    with sqlite_sessions() as s:
        dispatch_batch(s, relay_pub, clock, tables=tables, batch_size=10, max_attempts=3, base_delay_ms=1000, max_delay_ms=10_000,
                       routes=ROUTES, max_message_bytes=100_000, namespace="ns")
    # And a broker that lost two of the six messages: billing never got event 0, shipping never got event 2
    lost = {(str(ids[0]), "billing"), (str(ids[2]), "shipping")}
    spec = outbox.registry
    for m in relay_pub.published:
        if (m.properties["message_id"], m.consumer) not in lost:
            deliver(sqlite_sessions, spec[m.consumer], json.loads(m.body)[0][0], tables=tables, request_id=None,
                    settings=settings, clock=clock, first_delivery=True)
    # When the reconciler runs before the deadline, it waits; after it, it re-sends exactly the lost ones
    pub = InMemoryPublisher()
    clock.advance(AFTER // 2)
    assert run(sqlite_sessions, pub, clock, tables) == (0, 0)
    clock.advance(AFTER)
    assert run(sqlite_sessions, pub, clock, tables) == (6, 2)  # each consumer's window reads the three
    assert {(m.properties["message_id"], m.consumer) for m in pub.published} == lost
    assert {m.routing_key for m in pub.published} == {"ns.billing", "ns.shipping"}
    # And each row is checked once: the next pass sends nothing
    clock.advance(AFTER)
    assert run(sqlite_sessions, pub, clock, tables) == (0, 0)
    assert len(pub.published) == 2


def test_dead_letters_are_not_sent_again(settings: Settings, outbox: Outbox, sqlite_sessions: sessionmaker[Session],
                                        clock: ManualClock, tables: Tables) -> None:
    relay_pub = InMemoryPublisher()
    run(sqlite_sessions, relay_pub, clock, tables)
    clock.advance(AFTER)
    [mid] = insert_pending(sqlite_sessions, clock.now_ms(), 1, tables=tables, payload=lambda i, m: {"order_id": "bad"})
    with sqlite_sessions() as s:
        dispatch_batch(s, relay_pub, clock, tables=tables, batch_size=10, max_attempts=3, base_delay_ms=1000, max_delay_ms=10_000,
                       routes=ROUTES, max_message_bytes=100_000, namespace="ns")
    # Given a message every consumer dead-lettered (malformed payload, one delivery allowed)
    cfg = settings.replace(consumer_max_deliveries=1)
    for m in relay_pub.published:
        deliver(sqlite_sessions, outbox.registry[m.consumer], json.loads(m.body)[0][0], tables=tables, request_id=None,
                settings=cfg, clock=clock, first_delivery=True)
    # When the reconciler passes after the deadline
    clock.advance(2 * AFTER)
    pub = InMemoryPublisher()
    assert run(sqlite_sessions, pub, clock, tables) == (2, 0)  # dead letters are a person's job, not re-sent
    assert pub.published == [] and str(mid)


def test_a_down_broker_keeps_the_window_for_the_next_pass(sqlite_sessions: sessionmaker[Session],
                                                           clock: ManualClock, tables: Tables) -> None:
    # Given a published event no consumer recorded
    relay_pub = InMemoryPublisher()
    run(sqlite_sessions, relay_pub, clock, tables)
    clock.advance(AFTER)
    [mid] = insert_pending(sqlite_sessions, clock.now_ms(), 1, tables=tables, payload=order)
    with sqlite_sessions() as s:
        dispatch_batch(s, relay_pub, clock, tables=tables, batch_size=10, max_attempts=3, base_delay_ms=1000, max_delay_ms=10_000,
                       routes=ROUTES, max_message_bytes=100_000, namespace="ns")
    clock.advance(2 * AFTER)
    # When the broker is down for the reconciler's pass
    pub = InMemoryPublisher()
    pub.fail_unavailable(1)
    with sqlite_sessions() as s:
        r = reconcile(s, pub, clock, tables=tables, routes=ROUTES, namespace="ns", max_message_bytes=100_000, older_than_ms=AFTER)
    assert r.broker_unavailable and r.republished == 0
    # Then the next pass re-sends the same window: nothing skipped (each consumer's window reads the row)
    assert run(sqlite_sessions, pub, clock, tables) == (2, 2)
    assert {m.properties["message_id"] for m in pub.published} == {str(mid)}


def test_rows_sharing_one_published_instant_across_a_full_page_are_all_checked(
        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given a reconciler that has run once, and 1,500 events marked published by one batch (one instant),
    # none of which any consumer recorded (a broker that lost them all)
    assert run(sqlite_sessions, InMemoryPublisher(), clock, tables) == (0, 0)
    clock.advance(AFTER)
    insert_pending(sqlite_sessions, clock.now_ms(), 1500, tables=tables, payload=order)
    with sqlite_sessions() as s:
        dispatch_batch(s, InMemoryPublisher(), clock, tables=tables, batch_size=1500, max_attempts=3, base_delay_ms=1000,
                       max_delay_ms=10_000, routes=ROUTES, max_message_bytes=100_000, namespace="ns")
    # When the reconciler pages through them (1,000 rows a page, one page per pass)
    clock.advance(AFTER + 1)
    pub = InMemoryPublisher()
    first = run(sqlite_sessions, pub, clock, tables, max_pages=1)
    second = run(sqlite_sessions, pub, clock, tables, max_pages=1)
    third = run(sqlite_sessions, pub, clock, tables, max_pages=1)
    # Then every row is checked exactly once per consumer's window, none skipped at the page boundary inside
    # the shared instant
    assert (first, second, third) == ((2000, 2000), (1000, 1000), (0, 0))
    assert len(set(pub.deliveries())) == 3000 and pub.duplicates() == 0
