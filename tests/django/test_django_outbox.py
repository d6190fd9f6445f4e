"""Rule 1 on Django: the order and its outbox row commit together on Django's connection, or neither does.

Real Postgres, real commits (``django_db(transaction=True)``), the example shop's views through
Django's test client, and the real relay (``dispatch_batch`` with the in-memory publisher) reading
what Django wrote.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from django.db import connection, transaction
from django.db.models.signals import post_save
from django.http import HttpRequest, JsonResponse
from django.test import Client
from django.urls import include, path
from shop.models import Order, OrderLine, Shipment
from shop.services import place_order

import celery_outbox.contrib.django
from celery_outbox import writer as sa_writer
from celery_outbox.clock import ManualClock
from celery_outbox.contrib.django.models import OutboxMessage
from celery_outbox.db import make_session_factory
from celery_outbox.errors import MessageTooLargeError, SerializationError, TransactionRequiredError, ValidationError
from celery_outbox.messages import Envelope, task_name
from celery_outbox.schema import OutboxRow, Tables
from celery_outbox.writer import Event
from orders.service import ORDER_PLACED, parse_order

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]

ORDER = {"order_id": "o-1", "customer_id": "c-1", "email": "a@example.com", "currency": "EUR",
         "lines": [{"sku": "sku-1", "quantity": 2, "unit_price_cents": 500},
                   {"sku": "sku-2", "quantity": 1, "unit_price_cents": 250}]}


class PaymentDeclined(Exception):
    pass


def place_then_fail(request: HttpRequest) -> JsonResponse:
    """A view that places an order (order, lines, outbox row) and then fails in the same transaction."""
    with transaction.atomic():
        place_order(parse_order(json.loads(request.body)))
        raise PaymentDeclined("card declined after the order was written")


urlpatterns = [
    path("", include("shop_project.urls")),
    path("orders-then-fail", place_then_fail),
]


def counts() -> tuple[int, int, int]:
    return Order.objects.count(), OrderLine.objects.count(), OutboxMessage.objects.count()


def post_order(client: Client, body: Any, url: str = "/orders") -> Any:
    return client.post(url, data=json.dumps(body), content_type="application/json")


@pytest.fixture
def client() -> Client:
    return Client(raise_request_exception=True)


# -- the writer ------------------------------------------------------------------------------------

def test_publish_inside_atomic_commits_with_the_callers_data() -> None:
    clock = ManualClock(start_ms=1_700_000_123_000)
    # When an order and its event are written in one atomic block
    with transaction.atomic():
        Order.objects.create(id="o-9", customer_id="c", email="e@example.com", currency="EUR", total_cents=1,
                             created_at_ms=clock.now_ms())
        written = celery_outbox.contrib.django.publish(
            Event(type=ORDER_PLACED, payload={"order_id": "o-9"}, correlation_id="corr-1",
                  entity_key="order:o-9", entity_version=1), clock=clock)
    # Then both are committed, the row pending and due now
    assert Order.objects.filter(pk="o-9").exists()
    row = OutboxMessage.objects.get()
    assert row.seq == written.seq and row.message_id == written.message_id
    assert row.type == ORDER_PLACED and row.payload == {"order_id": "o-9"}
    assert row.headers == {"correlation_id": "corr-1", "entity_key": "order:o-9", "entity_version": 1}
    assert row.attempts == 0 and row.published_at_ms is None and row.dead_lettered_at_ms is None
    assert row.created_at_ms == row.next_attempt_at_ms == clock.now_ms()


def test_django_and_sqlalchemy_writers_write_the_same_row(sa_engine: sa.Engine, tables: Tables) -> None:
    # Given the same event written once by each writer
    clock = ManualClock()
    payload = {"order_id": "o-1", "lines": [{"sku": "a", "quantity": 1}], "note": "é"}
    with transaction.atomic():
        celery_outbox.contrib.django.publish(Event(type="OrderPlaced", payload=payload, entity_key="order:o-1", entity_version=3),
                          clock=clock)
    with make_session_factory(sa_engine)() as s:
        sa_writer.add(s, Event(type="OrderPlaced", payload=payload, entity_key="order:o-1", entity_version=3),
                      tables=tables, clock=clock)
        s.commit()
    # Then the relay's model reads two rows identical but for seq, message_id and correlation id
    with make_session_factory(sa_engine)() as s:
        rows = s.scalars(sa.select(tables.outbox).order_by(tables.outbox.seq)).all()
    assert len(rows) == 2

    def comparable(r: OutboxRow) -> dict[str, Any]:
        headers = dict(r.headers)
        assert headers.pop("correlation_id") == str(r.message_id)  # defaults to the message id on both
        return {"type": r.type, "payload": r.payload, "headers": headers, "created": r.created_at_ms,
                "due": r.next_attempt_at_ms, "attempts": r.attempts, "published": r.published_at_ms}

    assert comparable(rows[0]) == comparable(rows[1])


def test_publish_rolls_back_with_the_callers_atomic_block() -> None:
    # When the atomic block that wrote the event fails afterwards
    with pytest.raises(PaymentDeclined), transaction.atomic():
        celery_outbox.contrib.django.publish(Event(type=ORDER_PLACED, payload={"order_id": "o-1"}))
        raise PaymentDeclined
    # Then the event is gone with it
    assert OutboxMessage.objects.count() == 0


def test_publish_outside_a_transaction_is_refused_and_writes_nothing() -> None:
    # Given Django in autocommit (no atomic block)
    assert connection.get_autocommit()
    # When an event is added
    with pytest.raises(TransactionRequiredError, match=r"inside transaction\.atomic\(\)"):
        celery_outbox.contrib.django.publish(Event(type=ORDER_PLACED, payload={"order_id": "o-1"}))
    # Then nothing was written
    assert OutboxMessage.objects.count() == 0


@pytest.mark.parametrize(("event", "kwargs", "error"), [
    (Event(type="", payload={}), {}, ValidationError),
    (Event(type="OrderPlaced", payload={"when": {1, 2}}), {}, SerializationError),
    (Event(type="OrderPlaced", payload={"blob": "x" * 2000}), {"max_message_bytes": 1000}, MessageTooLargeError),
    (Event(type="Nobody", payload={}), {"known_types": ["OrderPlaced"]}, ValidationError.__base__),
    (Event(type="OrderPlaced", payload={}, entity_key="order:1", entity_version=0), {}, ValidationError),
])
def test_undeliverable_event_is_refused_before_anything_is_written(event: Event, kwargs: dict[str, Any],
                                                                  error: type[Exception]) -> None:
    # When an event that could never be delivered is added inside a transaction
    with pytest.raises(error), transaction.atomic():
        celery_outbox.contrib.django.publish(event, **kwargs)
    # Then nothing is written
    assert OutboxMessage.objects.count() == 0


# -- the example shop's views ----------------------------------------------------------------------

def test_view_that_places_an_order_then_raises_leaves_no_order_and_no_event(client: Client) -> None:
    # When a view places an order and then fails in the same transaction
    with pytest.raises(PaymentDeclined):
        post_order(client, ORDER, url="/orders-then-fail")
    # Then there is no order, no line and no outbox row
    assert counts() == (0, 0, 0)


@pytest.fixture
def failure_after_the_outbox_insert() -> Iterator[None]:
    def explode(**_: Any) -> None:
        raise PaymentDeclined("failure after the outbox row was inserted")

    post_save.connect(explode, sender=OutboxMessage, dispatch_uid="test-explode")
    yield
    post_save.disconnect(sender=OutboxMessage, dispatch_uid="test-explode")


@pytest.mark.usefixtures("failure_after_the_outbox_insert")
def test_shop_view_failing_after_the_outbox_insert_leaves_nothing(client: Client) -> None:
    # Given the shop's own view, failing right after it inserted the outbox row (a post_save hook)
    # When an order is posted
    with pytest.raises(PaymentDeclined):
        post_order(client, ORDER)
    # Then the whole transaction rolled back: no order, no line, no outbox row
    assert counts() == (0, 0, 0)


def test_shop_view_commits_order_and_event_and_the_relay_publishes_it(client: Client, sa_engine: sa.Engine,
                                                                      shop_outbox: Any) -> None:
    from celery_outbox.clock import SystemClock
    from celery_outbox.relay.dispatch import dispatch_with_settings
    from celery_outbox.testing.memory import InMemoryPublisher

    # When an order is posted to the shop
    response = post_order(client, ORDER)
    # Then the order, its lines and one pending OrderPlaced row are committed
    assert response.status_code == 201, response.content
    assert response.json()["total_cents"] == 1250
    assert counts() == (1, 2, 1)
    row = OutboxMessage.objects.get()
    assert row.type == ORDER_PLACED and row.published_at_ms is None
    assert client.get("/orders/o-1").json()["lines"][1]["sku"] == "sku-2"

    # When the relay runs a batch against the same database
    publisher = InMemoryPublisher()
    with make_session_factory(sa_engine)() as session:
        result = dispatch_with_settings(session, publisher, SystemClock(), shop_outbox.settings,
                                        tables=shop_outbox.tables, routes=shop_outbox.routes())
    # Then it published one task message for the Django consumer and marked the row
    assert result.published == 1
    assert [m.headers["task"] for m in publisher.published] == [task_name("fulfilment")]
    row.refresh_from_db()
    assert row.published_at_ms is not None
    envelope = json.loads(publisher.published[0].body)[0][0]
    assert Envelope.from_dict(envelope).message_id == row.message_id

    # When the Django consumer's Celery task gets that message twice (at-least-once)
    fulfilment = shop_outbox.task("fulfilment")
    assert fulfilment.name == task_name("fulfilment")
    outcomes = [fulfilment.apply(args=[envelope]).get() for _ in range(2)]
    # Then it shipped the order once
    assert outcomes == ["processed", f"duplicate of {envelope['message_id']}"]
    shipment = Shipment.objects.get()
    assert shipment.order_id == "o-1" and shipment.items == 3


def test_shop_view_duplicate_order_is_409_and_writes_no_second_event(client: Client) -> None:
    assert post_order(client, ORDER).status_code == 201
    # When the same order id is posted again
    response = post_order(client, {**ORDER, "email": "b@example.com"})
    # Then it is refused and nothing else is written
    assert response.status_code == 409 and "already exists" in response.json()["error"]
    assert counts() == (1, 2, 1)


@pytest.mark.parametrize("body", ["{not json", {"customer_id": "c"}, {**ORDER, "lines": []}])
def test_shop_view_rejects_invalid_orders_and_writes_nothing(client: Client, body: Any) -> None:
    response = client.post("/orders", data=body if isinstance(body, str) else json.dumps(body),
                           content_type="application/json")
    assert response.status_code == 400, response.content
    assert counts() == (0, 0, 0)


def test_message_ids_are_unique_per_event() -> None:
    with transaction.atomic():
        first = celery_outbox.contrib.django.publish(Event(type=ORDER_PLACED, payload={}))
        second = celery_outbox.contrib.django.publish(Event(type=ORDER_PLACED, payload={}))
    assert isinstance(first.message_id, uuid.UUID) and first.message_id != second.message_id
    assert second.seq > first.seq


def test_database_url_is_djangos_database_for_sqlalchemy(django_pg_url: str) -> None:
    from celery_outbox.contrib.django import database_settings, database_url

    # Django's DATABASES entry, as a SQLAlchemy URL, is the session's database (and round-trips)
    assert database_url() == django_pg_url
    assert database_settings(database_url())["NAME"] == database_settings(django_pg_url)["NAME"]
