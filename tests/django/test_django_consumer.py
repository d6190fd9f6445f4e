"""Rule 6 on Django: effect + inbox row in one ``transaction.atomic()``; the same message twice,
also in parallel from threads with their own connections, has one effect. Deliveries go through the
SHARED core (``celery_outbox.delivery.deliver``): counting, retry and dead letters are the library's."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from django.db import connections, transaction
from shop.models import Shipment
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.contrib.django import DjangoConsumerSpec, idempotent_consumer
from celery_outbox.contrib.django.consumer import already_processed
from celery_outbox.contrib.django.models import ConsumerCounter, ConsumerDeadLetter, DeliveryAttempt, InboxEntry
from celery_outbox.counters import DUPLICATES
from celery_outbox.delivery import Delivery, deliver, raw_text
from celery_outbox.errors import ConfigError
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

CONSUMER = "fulfilment"
SETTINGS = Settings()


def envelope(order_id: str = "o-1") -> dict[str, Any]:
    return Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload={"order_id": order_id, "items": 2},
                    headers={"correlation_id": "c"}, created_at_ms=1).to_dict()


def ship(env: Envelope) -> None:
    Shipment.objects.create(order_id=env.payload["order_id"], items=env.payload["items"], address_line="",
                            created_at_ms=1)


def consumer(effect: Callable[[Envelope], object] = ship, *, name: str = CONSUMER, **options: Any) -> DjangoConsumerSpec:
    return idempotent_consumer("OrderPlaced", name=name, **options)(effect)


@pytest.fixture
def delivered(sa_sessions: sessionmaker[Session], tables: Tables) -> Callable[..., Delivery]:
    """One delivery through the shared core, as the consumer's Celery task makes it."""

    def run(spec: DjangoConsumerSpec, body: Any, *, settings: Settings = SETTINGS, first: bool = True) -> Delivery:
        return deliver(sa_sessions, spec, body, tables=tables, request_id=None, settings=settings,
                       clock=ManualClock(start_ms=1_700_000_000_000), first_delivery=first)

    return run


def run_in_threads(n: int, fn: Callable[[], Outcome]) -> list[Outcome]:
    """Run ``fn`` in ``n`` threads released together; each thread has its own Django connection."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def work(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = fn()
        except BaseException as e:  # reported below, in the test's thread
            results[i] = e
        finally:
            connections.close_all()  # this thread's connections only

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a delivery thread hung"
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise AssertionError(f"delivery threads failed: {errors!r}") from errors[0]
    return results


def test_same_message_twice_has_one_effect(delivered: Callable[..., Delivery]) -> None:
    spec = consumer()
    msg = envelope()
    # When the same message is delivered twice
    outcomes = [delivered(spec, msg).outcome, delivered(spec, json.loads(json.dumps(msg))).outcome]
    # Then it was processed once and the second delivery is a duplicate (counted)
    assert outcomes == [Outcome.PROCESSED, Outcome.DUPLICATE]
    assert Shipment.objects.count() == 1
    assert InboxEntry.objects.filter(message_id=msg["message_id"], consumer=CONSUMER).count() == 1
    assert already_processed(msg["message_id"], CONSUMER)
    assert ConsumerCounter.total(CONSUMER, DUPLICATES) == 1


def test_without_the_fast_path_the_inbox_key_still_guarantees_one_effect(delivered: Callable[..., Delivery]) -> None:
    # Given a consumer that never asks "already seen?" (the primary key alone must hold)
    calls: list[str] = []

    def effect(env: Envelope) -> None:
        calls.append(str(env.message_id))
        ship(env)

    spec = consumer(effect, fast_path=False)
    msg = envelope()
    # When the message is delivered three times
    outcomes = [delivered(spec, msg).outcome for _ in range(3)]
    # Then the inbox key (a claim that inserted nothing) made the later two duplicates, one effect
    assert outcomes == [Outcome.PROCESSED, Outcome.DUPLICATE, Outcome.DUPLICATE]
    assert Shipment.objects.count() == 1 and len(calls) == 1
    assert ConsumerCounter.total(CONSUMER, DUPLICATES) == 2


def test_each_consumer_has_its_own_inbox_key(delivered: Callable[..., Delivery]) -> None:
    msg = envelope()
    assert delivered(consumer(name="a"), msg).outcome is Outcome.PROCESSED
    assert delivered(consumer(name="b"), msg).outcome is Outcome.PROCESSED
    assert Shipment.objects.count() == 2


def test_handler_failure_rolls_back_effect_and_inbox_row_then_redelivery_processes_once(
        delivered: Callable[..., Delivery]) -> None:
    attempts: list[int] = []

    def flaky(env: Envelope) -> None:
        ship(env)  # the effect is written...
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("downstream blip")  # ...and the delivery fails before its commit

    spec = consumer(flaky)
    msg = envelope()
    # When the first delivery fails after writing its effect
    first = delivered(spec, msg)
    # Then the core asks for a redelivery, counted in the database, and neither the effect nor the
    # inbox row was committed
    assert first.outcome is Outcome.RETRY and first.retry_in_s is not None and "downstream blip" in (first.error or "")
    assert Shipment.objects.count() == 0 and InboxEntry.objects.count() == 0
    assert DeliveryAttempt.objects.get(message_id=msg["message_id"], consumer=CONSUMER).deliveries == 1
    # And the redelivery processes it, once (and forgets the count)
    assert delivered(spec, msg, first=False).outcome is Outcome.PROCESSED
    assert delivered(spec, msg, first=False).outcome is Outcome.DUPLICATE
    assert Shipment.objects.count() == 1 and DeliveryAttempt.objects.count() == 0


def test_inside_an_outer_atomic_block_it_commits_or_rolls_back_with_it(sa_sessions: sessionmaker[Session],
                                                                       tables: Tables) -> None:
    spec = consumer()
    env = Envelope.from_dict(envelope())
    # When the consumer's inbox step runs inside a caller's atomic block that then fails
    with sa_sessions() as session:
        with pytest.raises(RuntimeError), transaction.atomic():
            assert spec.handle(session, env, tables=tables, clock=ManualClock()) is Outcome.PROCESSED
            raise RuntimeError("caller failed")
        # Then the effect and the inbox row rolled back with it, and the message is processed later
        assert Shipment.objects.count() == 0 and InboxEntry.objects.count() == 0
        assert spec.handle(session, env, tables=tables, clock=ManualClock()) is Outcome.PROCESSED


def lock_waiters(engine: sa.Engine) -> int:
    with engine.connect() as c:
        return int(c.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )).scalar_one())


def test_two_parallel_deliveries_one_processed_one_duplicate_one_effect(sa_engine: sa.Engine,
                                                                        delivered: Callable[..., Delivery]) -> None:
    # Given a consumer without the fast path whose effect waits until the other delivery is
    # blocked on the inbox key (so both really are inside their transactions at once)
    calls: list[int] = []

    def effect(env: Envelope) -> None:
        calls.append(threading.get_ident())
        deadline = time.monotonic() + 30
        while lock_waiters(sa_engine) < 1:
            assert time.monotonic() < deadline, "the second delivery never blocked on the inbox key"
            time.sleep(0.01)
        ship(env)

    spec = consumer(effect, fast_path=False)
    msg = envelope()
    # When two threads, each with its own connection, deliver the same message at the same time
    outcomes = run_in_threads(2, lambda: delivered(spec, msg).outcome)
    # Then one processed it, the other's claim waited and inserted nothing -> DUPLICATE, and there is one effect
    assert sorted(o.value for o in outcomes) == ["duplicate", "processed"]
    assert len(calls) == 1
    assert Shipment.objects.count() == 1 and InboxEntry.objects.count() == 1


def test_many_parallel_deliveries_have_one_effect(delivered: Callable[..., Delivery]) -> None:
    spec = consumer()
    msg = envelope()
    outcomes = run_in_threads(8, lambda: delivered(spec, msg).outcome)
    assert [o for o in outcomes if o is Outcome.PROCESSED] == [Outcome.PROCESSED]
    assert all(o in (Outcome.PROCESSED, Outcome.DUPLICATE) for o in outcomes)
    assert Shipment.objects.count() == 1
    assert ConsumerCounter.total(CONSUMER, DUPLICATES) == 7


@pytest.mark.parametrize("body", ["not json", {"type": "OrderPlaced", "payload": {}},
                                  {"message_id": "nope", "type": "OrderPlaced", "payload": {}}])
def test_malformed_message_is_dead_lettered_raw_and_writes_nothing_else(body: Any,
                                                                       delivered: Callable[..., Delivery]) -> None:
    calls: list[Envelope] = []
    spec = consumer(calls.append)
    # When a malformed body reaches its last allowed delivery
    result = delivered(spec, body, settings=Settings(consumer_max_deliveries=1))
    # Then the handler never ran, nothing was processed, and the raw body waits in the dead-letter store
    assert result.outcome is Outcome.DEAD_LETTERED and not calls
    assert InboxEntry.objects.count() == 0 and Shipment.objects.count() == 0
    letter = ConsumerDeadLetter.objects.get()
    assert letter.consumer == CONSUMER
    assert letter.body == raw_text(body)


def test_consumer_name_must_fit_the_inbox_column() -> None:
    with pytest.raises(ConfigError):
        idempotent_consumer("OrderPlaced", name="x" * 65)
    with pytest.raises(ConfigError):
        idempotent_consumer("OrderPlaced", name="")


def test_shop_task_dead_letters_a_poison_message_and_keeps_its_body(shop_outbox: Any) -> None:
    # Given an envelope whose payload the consumer cannot use
    poison = {**envelope(), "payload": {"no": "order id"}}
    # When the shop's Celery task receives it (eager retries: the shared core counts each delivery)
    result = shop_outbox.task("fulfilment").apply(args=[poison])
    # Then the task rejects its message for good (FAILURE with the reason in Flower, never requeued)
    assert result.state == "REJECTED" and result.result.requeue is False
    assert "dead-lettered for fulfilment after" in str(result.result)
    # And nothing was processed and the raw message waits in the dead-letter store after the
    # consumer's maximum deliveries
    assert InboxEntry.objects.count() == 0 and Shipment.objects.count() == 0
    letter = ConsumerDeadLetter.objects.get()
    assert letter.consumer == "fulfilment" and letter.message_id == poison["message_id"]
    assert letter.delivery_count == shop_outbox.settings.consumer_max_deliveries
    assert json.loads(letter.body) == poison and "order_id" in letter.last_error
    assert letter.headers == {"correlation_id": "c"} and letter.replayed_at_ms is None
