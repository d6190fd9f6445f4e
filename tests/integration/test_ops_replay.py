"""Replay after fixing the cause delivers exactly one effect per consumer; replaying again adds none.

The whole path is real except the broker: ``place_order`` writes the row, ``dispatch_batch`` publishes
to the in-memory publisher, and each task message is delivered through the consumers' own
``deliver`` (inbox, attempts, dead-letter store). Runs on SQLite and on Postgres.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Outbox, Tables
from celery_outbox.clock import ManualClock
from celery_outbox.consumer import ConsumerRegistry
from celery_outbox.delivery import deliver
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope, TaskMessage
from celery_outbox.ops import dead_letters as dl
from celery_outbox.relay.dispatch import dispatch_batch
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings
from consumers.effects import duplicates_absorbed, effect_counts
from orders.service import ORDER_PLACED, parse_order, place_order
from orders.tasks import NAME as CONFIRMATION


class Broken:
    """A dependency that is down until someone fixes it."""

    def __init__(self) -> None:
        self.down = True


@pytest.fixture
def broken() -> Broken:
    return Broken()


@pytest.fixture
def registry(broken: Broken, outbox: Outbox) -> ConsumerRegistry:
    base = outbox.registry
    ship = base["shipping"]

    def flaky(session: Session, envelope: Envelope) -> None:
        if broken.down:
            raise RuntimeError("carrier API is down")
        ship.handler(session, envelope)

    return ConsumerRegistry(specs=[dataclasses.replace(ship, handler=flaky),
                                   *(s for s in base if s.name != "shipping")])


def order(session: Session, order_id: str, outbox: Outbox) -> str:
    req = parse_order({"order_id": order_id, "customer_id": "c-1", "email": f"{order_id}@example.com",
                       "lines": [{"sku": "sku-1", "quantity": 1, "unit_price_cents": 500}]})
    place_order(session, req, outbox=outbox)
    return order_id


def relay_once(sessions: sessionmaker[Session], publisher: InMemoryPublisher, settings: Settings,
               clock: ManualClock, tables: Tables) -> None:
    with sessions() as s:
        dispatch_batch(s, publisher, clock, tables=tables, batch_size=100, max_attempts=settings.relay_max_attempts,
                       base_delay_ms=settings.relay_base_delay_ms, max_delay_ms=settings.relay_max_delay_ms,
                       routes=settings.routes, max_message_bytes=settings.max_message_bytes,
                       namespace=settings.namespace)


def deliver_all(sessions: sessionmaker[Session], messages: list[TaskMessage], registry: ConsumerRegistry,
                settings: Settings, clock: ManualClock, tables: Tables) -> list[Outcome]:
    """Deliver the event messages to their consumers; the e-mail task messages the relay also published are
    not run here (tests/unit/test_confirmation_email.py runs that task), so no e-mail is sent in this test."""
    outcomes = []
    for m in messages:
        if m.consumer == CONFIRMATION:
            continue
        (envelope,), _kw, _embed = json.loads(m.body)
        outcomes.append(deliver(sessions, registry[m.consumer], envelope, tables=tables, request_id=m.headers["id"],
                                settings=settings, clock=clock).outcome)
    return outcomes


def test_replay_after_fix_gives_one_effect_per_consumer(any_sessions: sessionmaker[Session], settings: Settings,
                                                        registry: ConsumerRegistry, broken: Broken,
                                                        clock: ManualClock, outbox: Outbox, tables: Tables) -> None:
    settings = settings.replace(consumer_max_deliveries=2, relay_max_attempts=2, relay_base_delay_ms=10)
    sessions = any_sessions
    # Given order A whose shipping delivery fails twice (dead letter), and order B the broker keeps rejecting
    with sessions() as s:
        order(s, "A", outbox)
    publisher = InMemoryPublisher()
    relay_once(sessions, publisher, settings, clock, tables)
    first = list(publisher.published)
    assert deliver_all(sessions, first, registry, settings, clock, tables).count(Outcome.PROCESSED) == 2
    shipping_msgs = [m for m in first if m.consumer == "shipping"]
    assert deliver_all(sessions, shipping_msgs, registry, settings, clock, tables) == [Outcome.DEAD_LETTERED]
    with sessions() as s:
        order(s, "B", outbox)
        b_id = s.scalars(sa.select(tables.outbox.message_id).where(tables.outbox.type == ORDER_PLACED)
                         .order_by(tables.outbox.seq.desc()).limit(1)).one()
    rejecting = InMemoryPublisher()
    rejecting.reject(b_id)
    for _ in range(2):
        relay_once(sessions, rejecting, settings, clock, tables)
        clock.advance(1_000)
    with sessions() as s:
        dead = dl.list_dead_letters(s, tables=tables)
        assert sorted(d.source for d in dead) == ["consumer", "outbox"]
        assert effect_counts(s) == {"shipping": 0, "billing": 1, "search": 1, "email": 0}

    # When the cause is fixed and everything is replayed (consumer rows through the consumers' path)
    broken.down = False
    fixed = InMemoryPublisher()

    def send(consumer: str, envelope: dict[str, Any]) -> None:
        deliver(sessions, registry[consumer], envelope, tables=tables, request_id=None, settings=settings, clock=clock)

    with sessions() as s:
        results = dl.replay_all(s, tables=tables, clock=clock, send=send, known_consumers=settings.consumers)
    assert [r.replayed for r in results] == [True, True]
    relay_once(sessions, fixed, settings, clock, tables)
    assert {m.consumer for m in fixed.published} == set(settings.consumers)
    deliver_all(sessions, list(fixed.published), registry, settings, clock, tables)

    # Then each consumer has exactly one effect per order and nothing is dead any more
    with sessions() as s:
        assert effect_counts(s) == {"shipping": 2, "billing": 2, "search": 2, "email": 0}
        assert dl.list_dead_letters(s, tables=tables) == []

    # When the same ids are replayed again, and the old messages are redelivered by the broker
    with sessions() as s:
        again = dl.replay(s, [r.id for r in results], tables=tables, clock=clock, send=send)
    assert [r.replayed for r in again] == [False, False]
    relay_once(sessions, fixed, settings, clock, tables)
    redelivered = deliver_all(sessions, [*first, *fixed.published], registry, settings, clock, tables)
    # Then all of it is absorbed as duplicates: still one effect each
    assert set(redelivered) == {Outcome.DUPLICATE}
    with sessions() as s:
        assert effect_counts(s) == {"shipping": 2, "billing": 2, "search": 2, "email": 0}
        assert sum(duplicates_absorbed(s, tables).values()) == len(redelivered)
