"""Per-entity ordering (rule 10) and ``prepare=`` on Django consumers, through the SHARED delivery core and
the library's one ordering implementation (``celery_outbox.inbox.ordering``) run on Django's own connection:
the entity's version, the parking lot, the inbox row and the ORM effect commit in one ``atomic()``."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from shop.models import Shipment
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.contrib.django import DjangoConsumerSpec, idempotent_consumer
from celery_outbox.contrib.django.models import (
    ConsumerCounter,
    ConsumerDeadLetter,
    EntityVersion,
    InboxEntry,
    ParkedMessage,
)
from celery_outbox.counters import DUPLICATES
from celery_outbox.delivery import Delivery, deliver
from celery_outbox.errors import ConfigError
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings
from tests.django.test_django_consumer import run_in_threads

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

CONSUMER = "ledger"
PARK_TIMEOUT_MS = 10_000


def v(n: int, *, order_id: str = "o-1") -> dict[str, Any]:
    """Version ``n`` of order ``order_id``, as a new message."""
    return Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload={"order_id": order_id, "version": n},
                    headers={"entity_key": f"order:{order_id}", "entity_version": n}, created_at_ms=1).to_dict()


def applied() -> list[str]:
    """The effects, in the order they were written."""
    return list(Shipment.objects.order_by("id").values_list("order_id", flat=True))


def record(env: Envelope) -> None:
    Shipment.objects.create(order_id=f"{env.payload['order_id']}@{env.payload['version']}", items=1,
                            created_at_ms=1)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start_ms=1_700_000_000_000)


@pytest.fixture
def delivered(sa_sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> Callable[..., Delivery]:
    """One delivery through the shared core, as the consumer's Celery task makes it."""

    def run(spec: DjangoConsumerSpec, body: Any, *, first: bool = True) -> Delivery:
        return deliver(sa_sessions, spec, body, tables=tables, request_id=None,
                       settings=Settings(consumer_park_timeout_ms=PARK_TIMEOUT_MS), clock=clock, first_delivery=first)

    return run


def ordered(effect: Callable[[Envelope], object] = record) -> DjangoConsumerSpec:
    return idempotent_consumer("OrderPlaced", name=CONSUMER, ordering=True)(effect)


def test_early_versions_park_stale_ones_are_skipped_and_the_gap_applies_them_in_order(
        delivered: Callable[..., Delivery]) -> None:
    spec = ordered()
    v1, v2, v3, v4 = v(1), v(2), v(3), v(4)
    # Given v1 applied
    assert delivered(spec, v1).outcome is Outcome.PROCESSED
    # When v4 and v3 arrive before v2, Then they are parked, not applied (a redelivery of a parked one: duplicate)
    assert delivered(spec, v4).outcome is Outcome.PARKED
    assert delivered(spec, v3).outcome is Outcome.PARKED
    assert delivered(spec, v3).outcome is Outcome.DUPLICATE
    assert applied() == ["o-1@1"] and ParkedMessage.objects.count() == 2
    # When v2 fills the gap, Then v2, v3, v4 are applied in order, with their inbox rows, in its transaction
    assert delivered(spec, v2).outcome is Outcome.PROCESSED
    assert applied() == ["o-1@1", "o-1@2", "o-1@3", "o-1@4"]
    assert ParkedMessage.objects.count() == 0
    assert EntityVersion.objects.get(consumer=CONSUMER, entity_key="order:o-1").version == 4
    assert InboxEntry.objects.filter(consumer=CONSUMER).count() == 4
    # When an older version arrives as a new message, Then it is STALE: recorded, no effect
    assert delivered(spec, v(2)).outcome is Outcome.STALE
    assert InboxEntry.objects.filter(consumer=CONSUMER).count() == 5
    # And a redelivery of an applied one is a DUPLICATE, counted
    assert delivered(spec, v4).outcome is Outcome.DUPLICATE
    assert applied() == ["o-1@1", "o-1@2", "o-1@3", "o-1@4"]
    assert ConsumerCounter.total(CONSUMER, DUPLICATES) == 2


def test_entities_are_independent_and_an_event_without_ordering_headers_passes(
        delivered: Callable[..., Delivery]) -> None:
    spec = ordered()
    assert delivered(spec, v(1, order_id="a")).outcome is Outcome.PROCESSED
    assert delivered(spec, v(3, order_id="a")).outcome is Outcome.PARKED
    assert delivered(spec, v(1, order_id="b")).outcome is Outcome.PROCESSED
    plain = {**v(7, order_id="c"), "headers": {}}
    assert delivered(spec, plain).outcome is Outcome.PROCESSED
    assert applied() == ["a@1", "b@1", "c@7"]


def test_an_effect_failing_while_the_gap_fills_rolls_back_the_versions_the_parking_lot_and_the_inbox(
        delivered: Callable[..., Delivery]) -> None:
    # Given v1 applied and v3 parked, and an effect that fails on v3 (applied in v2's transaction)
    failures: list[int] = []

    def effect(env: Envelope) -> None:
        record(env)
        if env.payload["version"] == 3 and not failures:
            failures.append(3)
            raise ConnectionError("downstream blip")

    spec = ordered(effect)
    v2 = v(2)
    assert delivered(spec, v(1)).outcome is Outcome.PROCESSED
    assert delivered(spec, v(3)).outcome is Outcome.PARKED
    # When v2 arrives and v3's effect fails after v2's was written
    result = delivered(spec, v2)
    # Then the delivery is retried and nothing of it stayed: not v2's effect, its version, its inbox row, nor
    # v3 leaving the parking lot (one transaction: Django's atomic() and the ordering's statements)
    assert result.outcome is Outcome.RETRY and "downstream blip" in (result.error or "")
    assert applied() == ["o-1@1"]
    assert EntityVersion.objects.get(consumer=CONSUMER, entity_key="order:o-1").version == 1
    assert ParkedMessage.objects.count() == 1 and InboxEntry.objects.count() == 1
    # And the redelivery applies v2 then v3, once each
    assert delivered(spec, v2, first=False).outcome is Outcome.PROCESSED
    assert applied() == ["o-1@1", "o-1@2", "o-1@3"]


def test_two_versions_delivered_in_parallel_are_applied_in_order(delivered: Callable[..., Delivery]) -> None:
    # Given v1 and v2 of one entity delivered at the same time by two threads, each with its own connection
    spec = ordered()
    bodies = iter([v(2), v(1)])
    lock = threading.Lock()

    def one() -> Outcome:
        with lock:
            body = next(bodies)
        return delivered(spec, body).outcome

    outcomes = run_in_threads(2, one)
    # Then both are applied, v1 before v2, whichever delivery ran first (v2 parked, or waiting on v1's lock)
    assert set(outcomes) <= {Outcome.PROCESSED, Outcome.PARKED} and Outcome.PROCESSED in outcomes
    assert applied() == ["o-1@1", "o-1@2"]
    assert EntityVersion.objects.get(consumer=CONSUMER, entity_key="order:o-1").version == 2
    assert ParkedMessage.objects.count() == 0


def test_a_parked_message_whose_gap_never_fills_is_dead_lettered_after_the_park_timeout(
        delivered: Callable[..., Delivery], clock: ManualClock) -> None:
    spec = ordered()
    v3 = v(3)
    assert delivered(spec, v(1)).outcome is Outcome.PROCESSED
    assert delivered(spec, v3).outcome is Outcome.PARKED
    # When a later delivery of the consumer comes after the park timeout with v2 still missing
    clock.advance(PARK_TIMEOUT_MS + 1)
    assert delivered(spec, v(1, order_id="other")).outcome is Outcome.PROCESSED
    # Then v3 is a dead letter of the consumer saying what it waited for, and left the parking lot
    letter = ConsumerDeadLetter.objects.get(consumer=CONSUMER)
    assert letter.message_id == v3["message_id"]
    assert "waiting for version 2" in letter.last_error and "version 3" in letter.last_error
    assert ParkedMessage.objects.count() == 0


def test_ordering_is_a_declared_option_and_cannot_be_combined_with_prepare() -> None:
    assert ordered().ordering is True
    with pytest.raises(ConfigError, match="cannot be combined with a prepare step"):
        idempotent_consumer("OrderPlaced", name=CONSUMER, ordering=True, prepare=lambda env: None)


def test_prepare_runs_before_the_transaction_and_the_fast_path_spares_a_redelivery_the_external_call(
        delivered: Callable[..., Delivery]) -> None:
    # Given a consumer whose external call (an e-mail provider, keyed by message id) runs in prepare
    calls: list[tuple[str, bool]] = []

    def send_mail(env: Envelope) -> None:
        calls.append((str(env.message_id), connection.in_atomic_block))

    spec = idempotent_consumer("OrderPlaced", name="mailer", prepare=send_mail)(record)
    msg = v(1)
    # When the message is delivered, then redelivered
    assert delivered(spec, msg).outcome is Outcome.PROCESSED
    assert delivered(spec, msg, first=False).outcome is Outcome.DUPLICATE
    # Then the provider was called once, outside any transaction, and the effect written once
    assert calls == [(msg["message_id"], False)]
    assert applied() == ["o-1@1"]


def test_without_the_fast_path_prepare_runs_again_and_the_inbox_key_still_gives_one_effect(
        delivered: Callable[..., Delivery]) -> None:
    calls: list[str] = []
    spec = idempotent_consumer("OrderPlaced", name="mailer", prepare=lambda env: calls.append(str(env.message_id)),
                               fast_path=False)(record)
    msg = v(1)
    assert [delivered(spec, msg).outcome for _ in range(2)] == [Outcome.PROCESSED, Outcome.DUPLICATE]
    assert calls == [msg["message_id"]] * 2  # the same idempotency key both times
    assert applied() == ["o-1@1"]


def test_a_failing_prepare_writes_nothing_and_is_retried(delivered: Callable[..., Delivery]) -> None:
    attempts: list[int] = []

    def flaky(env: Envelope) -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise TimeoutError("provider timed out")

    spec = idempotent_consumer("OrderPlaced", name="mailer", prepare=flaky)(record)
    msg = v(1)
    first = delivered(spec, msg)
    assert first.outcome is Outcome.RETRY and "provider timed out" in (first.error or "")
    assert applied() == [] and InboxEntry.objects.count() == 0
    assert delivered(spec, msg, first=False).outcome is Outcome.PROCESSED
    assert applied() == ["o-1@1"] and len(attempts) == 2
