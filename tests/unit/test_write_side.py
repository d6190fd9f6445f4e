"""Rule 1: the order and its outbox rows (the event, the e-mail task) commit together, or none does."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Outbox, writer
from celery_outbox.clock import ManualClock
from celery_outbox.errors import (
    MessageTooLargeError,
    SerializationError,
    UnknownEventTypeError,
    ValidationError,
)
from celery_outbox.schema import Tables
from orders.models import Order, OrderLine
from orders.service import ORDER_PLACED, DuplicateOrderError, parse_order, place_order
from orders.tasks import NAME as CONFIRMATION

ORDER = {"order_id": "o-1", "customer_id": "c-1", "email": "a@example.com", "currency": "EUR",
         "lines": [{"sku": "sku-1", "quantity": 2, "unit_price_cents": 500}]}


def count(sessions: sessionmaker[Session], model: type) -> int:
    with sessions() as s:
        return int(s.scalar(sa.select(sa.func.count()).select_from(model)) or 0)


def test_order_and_outbox_row_commit_together(any_sessions: sessionmaker[Session], clock: ManualClock,
                                              outbox: Outbox, tables: Tables) -> None:
    # Given a valid order
    req = parse_order(ORDER)
    # When it is placed
    with any_sessions() as s:
        place_order(s, req, outbox=outbox)
    # Then the order, its line, one pending OrderPlaced row and one pending confirmation e-mail task row exist
    with any_sessions() as s:
        rows = {r.type: r for r in s.scalars(sa.select(tables.outbox))}
        assert s.get(Order, "o-1") is not None
    assert count(any_sessions, OrderLine) == 1
    assert sorted(rows) == sorted([ORDER_PLACED, CONFIRMATION])
    row, task = rows[ORDER_PLACED], rows[CONFIRMATION]
    assert task.headers["outbox_kind"] == "task" and task.published_at_ms is None
    assert task.payload["body"][:2] == [["o-1"], {}]  # .delay(order_id): args, kwargs
    assert task.headers["queue"]["name"] == outbox.settings.queue_name("email")
    assert row.type == ORDER_PLACED
    assert row.payload["order_id"] == "o-1" and row.payload["total_cents"] == 1000
    assert row.published_at_ms is None and row.dead_lettered_at_ms is None
    assert row.attempts == 0 and row.next_attempt_at_ms == clock.now_ms() == row.created_at_ms
    assert row.headers["entity_key"] == "order:o-1" and row.headers["entity_version"] == 1


def test_failed_commit_leaves_neither_order_nor_outbox_row(any_sessions: sessionmaker[Session],
                                                           outbox: Outbox, tables: Tables) -> None:
    # Given an order already placed
    with any_sessions() as s:
        place_order(s, parse_order(ORDER), outbox=outbox)
    # When a second order with the same primary key is placed
    with any_sessions() as s, pytest.raises(DuplicateOrderError, match="already exists"):
        place_order(s, parse_order({**ORDER, "email": "b@example.com"}), outbox=outbox)
    # Then the commit failed as a whole: still one order and its two outbox rows (event, e-mail task), not four
    assert count(any_sessions, Order) == 1
    assert count(any_sessions, tables.outbox) == 2


def test_caller_rollback_discards_the_event(sqlite_sessions: sessionmaker[Session], clock: ManualClock,
                                           tables: Tables) -> None:
    with sqlite_sessions() as s:
        writer.add(s, writer.Event(type="OrderPlaced", payload={"order_id": "x"}), tables=tables, clock=clock)
        s.rollback()
    assert count(sqlite_sessions, tables.outbox) == 0


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("event", "error", "match"),
    [
        (writer.Event(type="", payload={}), ValidationError, "non-empty"),
        (writer.Event(type="OrderPlaced", payload={"x": object()}), SerializationError, "JSON"),
        (writer.Event(type="OrderPlaced", payload={"x": float("nan")}), SerializationError, "JSON"),
        (writer.Event(type="Nope", payload={}), UnknownEventTypeError, "no consumer is routed"),
        (writer.Event(type="OrderPlaced", payload={"blob": "x" * 2000}), MessageTooLargeError, "over the limit"),
        (writer.Event(type="OrderPlaced", payload={}, entity_key="order:1", entity_version=0),
         ValidationError, "entity_version"),
        # what the consumers would refuse: nested past their depth limit
        (writer.Event(type="OrderPlaced", payload={"x": nested(80)}), ValidationError, "nested deeper"),
        # what the database cannot store, and keys JSON cannot carry
        (writer.Event(type="OrderPlaced", payload={"x": "a\x00b"}), ValidationError, "cannot store"),
        (writer.Event(type="OrderPlaced", payload={"x": "\ud800"}), ValidationError, "cannot store"),
        (writer.Event(type="OrderPlaced", payload={"x": {1: "a", "b": 2}}), ValidationError, "non-string object key"),
        # within the limit as payload + headers, over it as the message the relay publishes
        (writer.Event(type="OrderPlaced", payload={"blob": "x" * 850}), MessageTooLargeError, "over the limit"),
    ],
)
def test_outbox_writer_refuses_undeliverable_events(sqlite_sessions: sessionmaker[Session], clock: ManualClock,
                                                    tables: Tables, event: writer.Event, error: type, match: str) -> None:
    with sqlite_sessions() as s:
        with pytest.raises(error, match=match):
            writer.add(s, event, tables=tables, clock=clock, max_message_bytes=1000, known_types=["OrderPlaced"])
        s.commit()
    assert count(sqlite_sessions, tables.outbox) == 0


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ([], "JSON object"),
        ({**ORDER, "extra": 1}, "unknown field"),
        ({**ORDER, "customer_id": None}, "customer_id"),
        ({**ORDER, "email": "nope"}, "email"),
        ({**ORDER, "currency": "euro"}, "currency"),
        ({**ORDER, "lines": []}, "non-empty"),
        ({**ORDER, "lines": [{"sku": "a", "quantity": 0, "unit_price_cents": 1}]}, "quantity"),
        ({**ORDER, "lines": [{"sku": "a", "quantity": True, "unit_price_cents": 1}]}, "quantity"),
        ({**ORDER, "lines": [{"sku": "a", "quantity": 1, "unit_price_cents": -1}]}, "unit_price_cents"),
        ({**ORDER, "order_id": "bad id with spaces"}, "order_id"),
    ],
)
def test_parse_order_names_the_bad_field(body: object, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        parse_order(body)


def test_an_event_the_writer_accepts_is_one_the_relay_and_the_consumers_accept(
        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    from celery_outbox.messages import Envelope, celery_task_messages

    # Given events nested right at the consumers' limit and sized right at the relay's limit
    limit = 1000
    for event in (writer.Event(type="OrderPlaced", payload={"x": nested(60)}),
                  writer.Event(type="OrderPlaced", payload={"blob": "x" * 700})):
        with sqlite_sessions() as s:
            row = writer.add(s, event, tables=tables, clock=clock, max_message_bytes=limit)
            s.commit()
            envelope = Envelope(message_id=row.message_id, type=row.type, payload=row.payload, headers=row.headers,
                                created_at_ms=row.created_at_ms)
        # Then what was accepted is published by the relay's measure and read by the consumers' check
        (message,) = celery_task_messages(envelope, targets=[("c", "q")], max_bytes=limit)
        assert Envelope.from_dict(envelope.to_dict()).message_id == envelope.message_id
        assert message.body
