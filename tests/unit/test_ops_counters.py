"""The Prometheus counters follow the real work: relay publishes and failures, consumer processing,
dead letters on both sides; and "processed" survives retention pruning the inbox (monotonic)."""

from __future__ import annotations

import json

from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.delivery import deliver
from celery_outbox.ops import retention
from celery_outbox.ops.metrics import make_registry, render
from celery_outbox.relay.dispatch import dispatch_batch
from celery_outbox.schema import Tables
from celery_outbox.testing.memory import InMemoryPublisher
from celery_outbox.writer import Event, add
from celeryconfig import Settings
from consumers.shipping import shipping
from tests.unit.test_ops_stats import samples

DAY = 86_400_000


def test_counters_after_a_scripted_run(settings: Settings, sqlite_sessions: sessionmaker[Session],
                                       clock: ManualClock, tables: Tables) -> None:
    # Given three events, one of a type the broker rejects for good (max_attempts = 1)
    routes = {"OrderPlaced": ("shipping",)}
    with sqlite_sessions() as s:
        for i in range(2):
            add(s, Event(type="OrderPlaced", payload={
                "order_id": f"o-{i}", "customer_id": "c", "email": "a@example.com", "currency": "EUR",
                "total_cents": 1, "lines": [{"sku": "s", "quantity": 1, "unit_price_cents": 1}]}), tables=tables, clock=clock)
        doomed = add(s, Event(type="OrderPlaced", payload={"order_id": "o-x"}), tables=tables, clock=clock)
        s.commit()
    pub = InMemoryPublisher()
    pub.reject(str(doomed.message_id), times=None, error="returned: NO_ROUTE")

    def relay_pass() -> None:
        with sqlite_sessions() as s:
            dispatch_batch(s, pub, clock, tables=tables, batch_size=10, max_attempts=1, base_delay_ms=1000, max_delay_ms=10_000,
                           routes=routes, max_message_bytes=100_000, namespace=settings.namespace)

    # When the broker is unreachable once, then the relay publishes
    pub.fail_unavailable(1)
    relay_pass()
    relay_pass()
    # And shipping handles each published message, one of them twice, and gets a poison message
    spec = shipping
    cfg = settings.replace(consumer_max_deliveries=1)
    bodies = [json.loads(m.body)[0][0] for m in pub.published]
    for body in [*bodies, bodies[0]]:
        deliver(sqlite_sessions, spec, body, tables=tables, request_id=None, settings=cfg, clock=clock, first_delivery=True)
    deliver(sqlite_sessions, spec, {**bodies[0], "message_id": "7d1b1c6e-0c1e-4f0a-9a53-5a3f0c2d8e99",
                                    "payload": "not json"}, tables=tables, request_id=None, settings=cfg, clock=clock,
            first_delivery=True)

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return samples(render(make_registry(tables=tables, session_factory=sqlite_sessions, clock=clock)).decode())

    got = scrape()
    # Then the counters say exactly what happened
    assert got[("outbox_relay_published_total", ())] == 2
    assert got[("outbox_relay_publish_failures_total", (("kind", "rejected"),))] == 1
    assert got[("outbox_relay_publish_failures_total", (("kind", "broker_unavailable"),))] == 1
    assert got[("outbox_dead_lettered_total", (("consumer", ""), ("source", "outbox")))] == 1
    assert got[("outbox_consumer_processed_total", (("consumer", "shipping"),))] == 2
    assert got[("outbox_duplicates_absorbed_total", (("consumer", "shipping"),))] == 1
    assert got[("outbox_dead_lettered_total", (("consumer", "shipping"), ("source", "consumer")))] == 1
    # And after retention prunes the inbox, "processed" does not go backwards
    clock.advance(10 * DAY)
    report = retention.prune(sqlite_sessions, tables=tables, inbox_older_than_ms=7 * DAY, published_older_than_ms=None,
                             clock=clock, redelivery_window_ms=DAY)
    assert report.inbox_deleted == 2
    after = scrape()
    assert after.get(("outbox_inbox_entries", (("consumer", "shipping"),)), 0) == 0
    assert after[("outbox_consumer_processed_total", (("consumer", "shipping"),))] == 2
