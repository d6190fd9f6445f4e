"""``DjangoOutbox``'s verbs, the same as ``Outbox``'s and ``FlaskOutbox``'s (tests/unit/test_front_doors.py), on
Django's own terms: ``consumer`` writes with the ORM, ``publish``/``cancel``/``enqueue`` take no session but
the ``atomic()`` open on the outbox's database (``using=`` names it), ``transaction()`` is that ``atomic()``.
docs/api.md's table of verbs and front doors names these tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from celery import _state as celery_state
from django.db import DEFAULT_DB_ALIAS, transaction
from shop.models import Shipment
from sqlalchemy.orm import Session

from celery_outbox.celery import beat
from celery_outbox.contrib.django import DjangoOutbox, use
from celery_outbox.contrib.django.dead_letters import registered
from celery_outbox.contrib.django.models import OutboxMessage
from celery_outbox.errors import ConfigError, TransactionRequiredError
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.settings import Settings
from celery_outbox.testing import run_pending
from celery_outbox.writer import Event

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

TASK = "front_door.django_write_shipment"
BEAT_ENTRY = "front-door-every-minute"


def declare(outbox: DjangoOutbox) -> Any:
    """What a project's modules declare at import on ``proj.celery.outbox``; returns the task."""

    @outbox.consumer("OrderPlaced", name="front-door-shipping")
    def ship(envelope: Envelope) -> None:  # the ORM, in the consumer's atomic()
        Shipment.objects.create(order_id=f"consumer:{envelope.payload['order_id']}", items=1, created_at_ms=1)

    @outbox.task(name=TASK)
    def write_shipment(session: Session, order_id: str) -> None:  # SQLAlchemy, on Django's database
        session.execute(sa.text("INSERT INTO shipments (order_id, address_line, items, created_at_ms) "
                                "VALUES (:o, '', 1, 1)"), {"o": f"task:{order_id}"})

    outbox.periodic(BEAT_ENTRY, TASK, 60.0, args=("tick",))
    return write_shipment


@dataclass
class Door:
    outbox: DjangoOutbox
    task: Any

    def shipments(self) -> list[str]:
        return sorted(Shipment.objects.values_list("order_id", flat=True))

    def pending(self) -> int:
        return int(OutboxMessage.objects.filter(published_at_ms__isnull=True).count())


@pytest.fixture
def door() -> Iterator[Door]:
    saved_app, saved_outbox = celery_state.default_app, registered()
    app = Celery(f"front{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    outbox = DjangoOutbox(app, settings=Settings(namespace=f"dj{uuid.uuid4().hex[:8]}"))
    try:
        yield Door(outbox=outbox, task=declare(outbox))
    finally:
        celery_state.set_default_app(saved_app)
        use(saved_outbox)


def test_consumer(door: Door) -> None:
    # Given the ORM consumer declared by declare(), When an event for it commits and the relay runs
    with transaction.atomic():
        door.outbox.publish(Event("OrderPlaced", {"order_id": "o-1"}))
    # Then it ran once, its ORM write committed with its inbox row
    assert run_pending(door.outbox) == {"front-door-shipping": [Outcome.PROCESSED]}
    assert door.shipments() == ["consumer:o-1"]


def test_publish(door: Door) -> None:
    # Given no transaction, Then publish refuses (the event would commit apart from the data it describes)
    with pytest.raises(TransactionRequiredError):
        door.outbox.publish(Event("OrderPlaced", {"order_id": "o-1"}))
    # When it is published in an atomic() that rolls back, Then nothing is pending
    with pytest.raises(RuntimeError), transaction.atomic():
        door.outbox.publish(Event("OrderPlaced", {"order_id": "o-1"}))
        raise RuntimeError("the view failed")
    assert door.pending() == 0
    # When it commits (using= naming the outbox's database), Then its row is pending for the relay
    with transaction.atomic():
        row = door.outbox.publish(Event("OrderPlaced", {"order_id": "o-2"}), using=DEFAULT_DB_ALIAS)
    assert row.type == "OrderPlaced" and door.pending() == 1
    # And another database, which this outbox's relay never reads, is refused
    with pytest.raises(ConfigError, match="whose relay would never see the row"), transaction.atomic():
        door.outbox.publish(Event("OrderPlaced", {"order_id": "o-3"}), using="elsewhere")


def test_task(door: Door) -> None:
    # Given the idempotent task declared by declare()
    assert TASK in door.outbox.idempotent_tasks()
    # When it is sent inside atomic() and the relay and the worker run
    with transaction.atomic():
        result = door.task.delay("o-1")
    assert run_pending(door.outbox) == {TASK: [Outcome.PROCESSED]}
    # Then its effect is written once, and a second run of the same task id has none
    door.task.apply(args=("o-1",), task_id=result.id)
    assert door.shipments() == ["task:o-1"]


def test_cancel(door: Door) -> None:
    # Given a task committed to the outbox and not yet relayed
    with transaction.atomic():
        task_id = door.task.delay("o-1").id
    # When it is cancelled inside atomic(), no session needed
    with transaction.atomic():
        cancelled = door.outbox.cancel(task_id, using=DEFAULT_DB_ALIAS)
    # Then its row is gone and the relay has nothing to send
    assert str(cancelled.message_id) == task_id and cancelled.type == TASK
    assert door.pending() == 0 and run_pending(door.outbox) == {}


def test_periodic(door: Door) -> None:
    entry = door.outbox.app.conf.beat_schedule[BEAT_ENTRY]
    assert entry["task"] == TASK and entry["args"] == ("tick",)
    assert entry["options"]["headers"][beat.BEAT_HEADER] == BEAT_ENTRY


def test_transaction(door: Door) -> None:
    # Given outbox.transaction(): Django's atomic() on the outbox's database
    with pytest.raises(RuntimeError), door.outbox.transaction():
        Shipment.objects.create(order_id="own", items=1, created_at_ms=1)
        door.task.delay("o-1")
        raise RuntimeError("the view failed")
    # Then a failure rolls back the ORM write and the task together
    assert door.pending() == 0 and door.shipments() == []
    with door.outbox.transaction():
        Shipment.objects.create(order_id="own", items=1, created_at_ms=1)
        door.task.delay("o-2")
    assert door.pending() == 1 and door.shipments() == ["own"]


def test_enqueue(door: Door) -> None:
    # Given no transaction, Then enqueue refuses
    with pytest.raises(TransactionRequiredError):
        door.outbox.enqueue(door.task.s("o-1"))
    # When the task is enqueued twice with one dedup key inside atomic()
    with transaction.atomic():
        first = door.outbox.enqueue(door.task.s("o-1"), dedup_key="ship:o-1")
        second = door.outbox.enqueue(door.task.s("o-1"), dedup_key="ship:o-1")
    # Then one row is pending, both results name its task id, and it runs once
    assert door.pending() == 1 and first.id == second.id
    assert run_pending(door.outbox) == {TASK: [Outcome.PROCESSED]}
    assert door.shipments() == ["task:o-1"]
