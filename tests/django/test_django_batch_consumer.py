"""Batch consumers on Django: ``@idempotent_consumer(..., batch_size=N)`` takes ``handler(envelopes)``; the batch's
inbox rows (claimed in one statement) and its ORM writes commit in ONE ``atomic()``; a poison message is
isolated by the shared core (``celery_outbox.batch_delivery``) and dead-lettered alone."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from shop.models import Shipment
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.batch_delivery import BatchItem, deliver_batch
from celery_outbox.clock import ManualClock
from celery_outbox.contrib.django import idempotent_consumer
from celery_outbox.contrib.django.models import ConsumerCounter, ConsumerDeadLetter, DeliveryAttempt, InboxEntry
from celery_outbox.errors import ConfigError
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def envelope(order_id: str) -> Envelope:
    return Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload={"order_id": order_id, "items": 2})


def item(env: Envelope, **flags: Any) -> BatchItem:
    return BatchItem(body=json.dumps(env.to_dict()), **flags)


calls: list[list[str]] = []


@idempotent_consumer("OrderPlaced", name="fulfilment", batch_size=50, batch_wait_ms=10, max_retries=0)
def ship_all(envelopes: list[Envelope]) -> None:
    ids = [str(e.payload["order_id"]) for e in envelopes]
    calls.append(ids)
    if "poison" in ids:
        raise ValueError("cannot ship poison")
    Shipment.objects.bulk_create([Shipment(order_id=i, items=2, created_at_ms=1) for i in ids])


def test_a_django_batch_commits_its_inbox_rows_with_the_bulk_effect_and_isolates_a_poison_message(
        sa_sessions: sessionmaker[Session], tables: Tables) -> None:
    calls.clear()
    done = envelope("o-done")
    batch = [envelope("o-1"), envelope("poison"), envelope("o-2"), done]
    deliver_batch(sa_sessions, ship_all, [item(done)], tables=tables, settings=Settings(), clock=ManualClock())
    with CaptureQueriesContext(connection) as queries:
        results = deliver_batch(sa_sessions, ship_all, [item(e) for e in batch] + [item(batch[0])], tables=tables,
                                settings=Settings(), clock=ManualClock())
    # max_retries=0: one delivery, so the poison message is dead-lettered at once, with its own error
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.DEAD_LETTERED, Outcome.PROCESSED,
                                            Outcome.DUPLICATE, Outcome.DUPLICATE]
    assert sorted(Shipment.objects.values_list("order_id", flat=True)) == ["o-1", "o-2", "o-done"]
    assert InboxEntry.objects.filter(consumer="fulfilment").count() == 3
    dead = ConsumerDeadLetter.objects.get()
    assert (dead.message_id, dead.last_error) == (str(batch[1].message_id), "ValueError: cannot ship poison")
    assert DeliveryAttempt.objects.filter(message_id=batch[0].message_id).count() == 0  # neighbours uncounted
    assert calls[1] == ["o-1", "poison", "o-2"]  # the first batch: one call with the first deliveries only
    claims = [q["sql"] for q in queries.captured_queries if q["sql"].startswith('INSERT INTO "outbox_inbox"')]
    # one claim statement per batch run: the whole, its two halves, o-1 and poison alone, poison's own delivery
    assert len(claims) == 6
    counts = {c.name.split("#")[0]: 0 for c in ConsumerCounter.objects.filter(consumer="fulfilment")}
    for c in ConsumerCounter.objects.filter(consumer="fulfilment"):
        counts[c.name.split("#")[0]] += c.value
    assert counts["duplicates"] == 2 and counts["batches"] >= 2


def test_django_refuses_batch_size_on_an_ordered_consumer() -> None:
    with pytest.raises(ConfigError, match="ordered consumer \\(ordering=True\\) cannot take batch_size"):
        idempotent_consumer("OrderPlaced", name="x", ordering=True, batch_size=10)
