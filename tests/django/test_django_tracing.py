"""Tracing on Django: an order posted to the shop inside a trace is one trace through the relay to the consumer.

The Django writer (``celery_outbox.contrib.django.publish``) shares ``writer.outbox_values`` with the
SQLAlchemy one, so it writes the current trace context into the row's headers the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from django.test import Client
from django.urls import include, path
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from celery_outbox.clock import SystemClock
from celery_outbox.contrib.django.models import OutboxMessage
from celery_outbox.db import make_session_factory
from celery_outbox.relay.dispatch import dispatch_with_settings
from celery_outbox.testing.memory import InMemoryPublisher
from tests.support.tracing import memory_tracer

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]

urlpatterns = [path("", include("shop_project.urls"))]

ORDER = {"order_id": "o-1", "customer_id": "c-1", "email": "a@example.com", "currency": "EUR",
         "lines": [{"sku": "sku-1", "quantity": 2, "unit_price_cents": 500}]}


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """An SDK tracer provider exporting to memory, as the global provider for this test only."""
    with memory_tracer(monkeypatch) as exporter:
        yield exporter


def span_ids(traceparent: Any) -> tuple[int, int]:
    _version, trace_id, span_id, _flags = str(traceparent).split("-")
    return int(trace_id, 16), int(span_id, 16)


def test_a_django_order_is_one_trace_from_the_view_to_the_consumer(exporter: InMemorySpanExporter,
                                                                   sa_engine: sa.Engine, shop_outbox: Any) -> None:
    # Given a request span current while the shop's view runs (what a Django instrumentation opens)
    with otel_trace.get_tracer("test").start_as_current_span("POST /orders", kind=SpanKind.SERVER) as request:
        # When an order is posted
        response = Client(raise_request_exception=True).post("/orders", data=json.dumps(ORDER),
                                                             content_type="application/json")
    assert response.status_code == 201, response.content
    ctx = request.get_span_context()
    # Then the Django writer put the request's context into the outbox row
    row = OutboxMessage.objects.get()
    assert span_ids(row.headers["traceparent"]) == (ctx.trace_id, ctx.span_id)

    # When the relay publishes it and the Django consumer's task runs it
    publisher = InMemoryPublisher()
    with make_session_factory(sa_engine)() as session:
        result = dispatch_with_settings(session, publisher, SystemClock(), shop_outbox.settings,
                                        tables=shop_outbox.tables, routes=shop_outbox.routes())
    assert result.published == 1
    envelope = json.loads(publisher.published[0].body)[0][0]
    assert shop_outbox.task("fulfilment").apply(args=[envelope]).get() == "processed"

    # Then request -> relay -> consumer is one chain of parent and child in one trace
    spans = {s.name: s for s in exporter.get_finished_spans()}
    relay, consumer = spans["publish OrderPlaced"], spans["process fulfilment"]
    assert relay.parent is not None and relay.parent.span_id == ctx.span_id
    assert span_ids(envelope["headers"]["traceparent"]) == (ctx.trace_id, relay.context.span_id)
    assert consumer.parent is not None and consumer.parent.span_id == relay.context.span_id
    assert {relay.context.trace_id, consumer.context.trace_id} == {ctx.trace_id}
    assert consumer.attributes is not None and consumer.attributes["outbox.outcome"] == "processed"
