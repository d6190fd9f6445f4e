"""Transactional enqueue on Django: inside ``transaction.atomic()``, ``task.delay()`` is an outbox row
written through the Django ORM, committed or rolled back with the view's data; the relay (SQLAlchemy,
in-memory publisher) publishes it as the task's own Celery message.

Real Postgres, real commits (``django_db(transaction=True)``), the example shop's ``Outbox``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import transaction
from shop.models import Order

from celery_outbox.contrib.django.models import OutboxMessage
from celery_outbox.errors import SerializationError, TransactionRequiredError
from celery_outbox.testing import drain

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def set_routes(app: Any, routes: Any) -> None:
    """Change ``task_routes`` on an app that may have routed already (Celery caches its router)."""
    app.conf.task_routes = routes
    app.amqp.flush_routes()
    app.amqp.__dict__.pop("router", None)


@pytest.fixture
def confirm(shop_outbox: Any) -> Iterator[Any]:
    """A task of the shop's app (defined here for the test), routed to its own queue."""
    name = f"shop.confirm_{uuid.uuid4().hex[:8]}"
    app = shop_outbox.app
    saved = app.conf.task_routes
    set_routes(app, {**(saved or {}), name: {"queue": f"{name}.q"}})

    @app.task(name=name, shared=False)  # type: ignore[untyped-decorator]
    def confirm_order(order_id: str) -> str:
        return order_id

    yield confirm_order
    set_routes(app, saved)
    app.tasks.unregister(name)


def make_order(order_id: str) -> None:
    Order.objects.create(id=order_id, customer_id="c-1", email="a@example.com", currency="EUR",
                         total_cents=100, created_at_ms=0)


def test_inside_atomic_the_task_is_a_row_and_the_relay_publishes_it(shop_outbox: Any, confirm: Any) -> None:
    # Given a view body that keeps its .delay() inside atomic()
    with transaction.atomic():
        make_order("o-1")
        result = confirm.delay("o-1")
        # Then the row is written on Django's connection, in the view's transaction
        row = OutboxMessage.objects.get(message_id=uuid.UUID(result.id))
        assert row.type == confirm.name and row.headers["outbox_kind"] == "task"
    # When the relay runs after the commit
    [message] = drain(shop_outbox).published
    # Then it publishes the task itself: name, id, arguments, its own queue
    assert message.headers["task"] == confirm.name and message.headers["id"] == result.id
    assert json.loads(message.body)[0] == ["o-1"] and message.routing_key == f"{confirm.name}.q"


def test_rollback_leaves_no_row_and_nothing_is_published(shop_outbox: Any, confirm: Any) -> None:
    # Given a view that enqueues, then fails in the same atomic()
    with pytest.raises(RuntimeError), transaction.atomic():
        make_order("o-2")
        confirm.delay("o-2")
        raise RuntimeError("payment declined")
    # Then neither the order nor the task row exists, and the relay publishes nothing
    assert not Order.objects.filter(id="o-2").exists()
    assert OutboxMessage.objects.count() == 0
    assert drain(shop_outbox).published == []


def test_a_savepoint_rolled_back_takes_its_task_with_it(shop_outbox: Any, confirm: Any) -> None:
    with transaction.atomic():
        kept = confirm.delay("kept")
        with pytest.raises(RuntimeError), transaction.atomic():
            confirm.delay("dropped")
            raise RuntimeError("inner step failed")
    assert [m.headers["id"] for m in drain(shop_outbox).published] == [kept.id]


def test_outside_atomic_raises_and_bad_arguments_are_refused_inside(shop_outbox: Any, confirm: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Given no atomic() (autocommit) and the strict mode, Then delay() refuses and writes nothing
    monkeypatch.setattr(shop_outbox, "settings", shop_outbox.settings.replace(enqueue_outside_transaction="raise"))
    with pytest.raises(TransactionRequiredError):
        confirm.delay("o-3")
    # Given atomic(), When an argument is not JSON, Then delay() raises there and nothing is written
    with transaction.atomic(), pytest.raises(SerializationError, match="JSON only"):
        confirm.delay(object())
    assert OutboxMessage.objects.count() == 0
