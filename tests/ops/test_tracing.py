"""Tracing: one trace shows request -> outbox row -> relay -> consumer, through an in-memory span exporter.

The SDK's tracer provider is installed for one test at a time (the API's global is patched and restored),
so every other test in the session runs with tracing off, as a deployment without an SDK does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from flask import Flask
from opentelemetry import propagate
from opentelemetry import trace as otel_trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import CarrierT, Setter, TextMapPropagator, default_setter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Event, Outbox, tracing
from celery_outbox.clock import ManualClock
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope, TaskMessage, celery_task_message, celery_task_messages
from celery_outbox.schema import Tables
from celery_outbox.testing import InMemoryPublisher, deliver_message, drain, run_pending
from celeryconfig import Settings
from orders.tasks import NAME as CONFIRMATION
from relay.web import create_app
from tests.support.tracing import memory_tracer

ROOT = Path(__file__).resolve().parents[2]
ORDER = {"order_id": "o-trace-1", "customer_id": "c-1", "email": "a@example.com",
         "lines": [{"sku": "sku-1", "quantity": 2, "unit_price_cents": 500}]}


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """An SDK tracer provider exporting to memory, as the global provider for this test only."""
    with memory_tracer(monkeypatch) as exporter:
        yield exporter


@pytest.fixture
def tiny(settings: Settings, sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> Outbox:
    """A small application on the public API: ``ok`` handles Ping (and publishes Pong), ``boom`` always fails."""
    app = Celery("tiny", set_as_current=False)
    app.conf.update(accept_content=["json"], task_serializer="json", broker_url="memory://")
    box = Outbox(app, settings=settings.replace(routes={}), session_factory=sqlite_sessions, clock=clock)
    box._tables = tables

    @box.consumer("Ping", name="ok")
    def ok(session: Session, envelope: Envelope) -> None:
        box.publish(session, Event("Pong", {"n": envelope.payload["n"]}))

    @box.consumer("Pong", name="pong")
    def pong(session: Session, envelope: Envelope) -> None:
        pass

    @box.consumer("Boom", name="boom", max_retries=0)
    def boom(session: Session, envelope: Envelope) -> None:
        raise RuntimeError("boom")

    return box


def traced_wsgi(app: Flask) -> None:
    """What a WSGI/Flask instrumentation does: a SERVER span per request, continuing the caller's trace."""
    inner = app.wsgi_app
    tracer = otel_trace.get_tracer("test.web")

    def wsgi(environ: dict[str, Any], start_response: Any) -> Any:
        carrier = {k[5:].lower().replace("_", "-"): v for k, v in environ.items() if k.startswith("HTTP_")}
        with tracer.start_as_current_span(f"{environ['REQUEST_METHOD']} {environ['PATH_INFO']}",
                                          context=propagate.extract(carrier), kind=SpanKind.SERVER):
            return inner(environ, start_response)

    app.wsgi_app = wsgi  # type: ignore[method-assign]


def row_headers(sessions: sessionmaker[Session], tables: Tables, kind: str | None = None) -> list[dict[str, Any]]:
    """The outbox rows' headers in order (only rows of type ``kind`` when given)."""
    stmt = sa.select(tables.outbox.headers).order_by(tables.outbox.seq)
    with sessions() as s:
        return [dict(h) for h in s.scalars(stmt if kind is None else stmt.where(tables.outbox.type == kind))]


def envelope_headers(message: TaskMessage) -> dict[str, Any]:
    return dict(json.loads(message.body)[0][0]["headers"])


def traceparent(trace_id: int, span_id: int) -> str:
    """The W3C traceparent of a sampled span, without its flags byte."""
    return f"00-{trace_id:032x}-{span_id:016x}"


def ids(header: Any) -> str:
    """A traceparent header without its flags byte (the SDK may set more than 'sampled')."""
    assert isinstance(header, str)
    return header.rsplit("-", 1)[0]


def named(spans: tuple[ReadableSpan, ...], prefix: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name.startswith(prefix)]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_one_order_is_one_trace_from_the_request_through_the_relay_to_every_consumer(
        exporter: InMemorySpanExporter, settings: Settings, sqlite_sessions: sessionmaker[Session],
        clock: ManualClock, outbox: Outbox, tables: Tables) -> None:
    # Given the orders web app behind a request-span middleware, and a client calling it inside its own span
    app = create_app(settings=settings, session_factory=sqlite_sessions, clock=clock)
    traced_wsgi(app)
    client_tracer = otel_trace.get_tracer("test.client")
    with client_tracer.start_as_current_span("client", kind=SpanKind.CLIENT) as client_span:
        sent: dict[str, str] = {}
        propagate.inject(sent)
        # When it posts an order
        response = app.test_client().post("/orders", json=ORDER, headers=sent)
    assert response.status_code == 201, response.json
    trace_id = client_span.get_span_context().trace_id
    (request,) = named(exporter.get_finished_spans(), "POST /orders")

    # Then the event's outbox row carries the request span's context (next to the outbox's own headers);
    # the order's confirmation e-mail task row (orders/tasks.py) is a Celery task, not traced here
    (headers,) = row_headers(sqlite_sessions, tables, "OrderPlaced")
    assert ids(headers["traceparent"]) == traceparent(trace_id, request.context.span_id)
    assert headers["correlation_id"]

    # When the relay drains it and every consumer handles its message
    publisher = drain(outbox)
    publisher.published[:] = [m for m in publisher.published if m.consumer != CONFIRMATION]  # the events only
    outcomes = [deliver_message(outbox, m) for m in publisher.published]
    assert outcomes and set(outcomes) == {Outcome.PROCESSED}

    # Then one PRODUCER span, a child of the request, published it; every envelope carries that span
    spans = exporter.get_finished_spans()
    (relay,) = named(spans, "publish OrderPlaced")
    assert relay.kind is SpanKind.PRODUCER and parent_of(relay) == request.context.span_id
    assert relay.context.trace_id == trace_id
    assert relay.attributes is not None and relay.attributes["outbox.outcome"] == "published"
    assert relay.attributes["messaging.system"] == "celery"
    assert {ids(envelope_headers(m)["traceparent"]) for m in publisher.published} == {
        traceparent(trace_id, relay.context.span_id)}

    # And one CONSUMER span per consumer, a child of the relay's span, in the same trace, with its outcome
    consumers = named(spans, "process ")
    assert sorted(s.name for s in consumers) == sorted(f"process {m.consumer}" for m in publisher.published)
    message_id = str(publisher.published[0].headers["outbox_message_id"])
    for span in consumers:
        assert span.kind is SpanKind.CONSUMER
        assert span.context.trace_id == trace_id and parent_of(span) == relay.context.span_id
        attrs = dict(span.attributes or {})
        consumer = span.name.removeprefix("process ")
        assert attrs["messaging.system"] == "celery"
        assert attrs["messaging.destination.name"] == settings.queue_name(consumer)
        assert attrs["messaging.message.id"] == message_id
        assert attrs["messaging.consumer.group.name"] == attrs["outbox.consumer"] == consumer
        assert attrs["outbox.event_type"] == "OrderPlaced" and attrs["outbox.outcome"] == "processed"
        assert span.status.status_code is StatusCode.UNSET


def test_an_event_published_by_a_consumer_continues_the_trace(exporter: InMemorySpanExporter, tiny: Outbox) -> None:
    # Given a Ping written inside a span
    with otel_trace.get_tracer("test").start_as_current_span("job") as job, tiny.sessions()() as s:
        tiny.publish(s, Event("Ping", {"n": 1}))
        s.commit()
    # When it is relayed and handled, and the Pong its consumer published is relayed and handled
    assert run_pending(tiny) == {"ok": [Outcome.PROCESSED]}
    assert run_pending(tiny) == {"pong": [Outcome.PROCESSED]}
    # Then job -> publish Ping -> process ok -> publish Pong -> process pong is one chain
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    chain = ["job", "publish Ping", "process ok", "publish Pong", "process pong"]
    assert set(chain) <= set(by_name)
    for parent, child in pairwise(chain):
        assert by_name[child].context.trace_id == job.get_span_context().trace_id
        assert parent_of(by_name[child]) == by_name[parent].context.span_id


def test_a_failed_delivery_ends_its_span_as_an_error_with_the_outcome(exporter: InMemorySpanExporter,
                                                                       tiny: Outbox) -> None:
    # Given a Boom written inside a span, for a consumer that always fails and is never retried
    with otel_trace.get_tracer("test").start_as_current_span("job"), tiny.sessions()() as s:
        tiny.publish(s, Event("Boom", {}))
        s.commit()
    # When it is relayed and delivered
    assert run_pending(tiny) == {"boom": [Outcome.DEAD_LETTERED]}
    # Then the consumer's span is an error saying why, with the dead-letter outcome
    (span,) = named(exporter.get_finished_spans(), "process boom")
    assert span.status.status_code is StatusCode.ERROR
    assert "RuntimeError: boom" in (span.status.description or "")
    assert span.attributes is not None and span.attributes["outbox.outcome"] == "dead_lettered"
    assert span.attributes["outbox.deliveries"] == 1


@pytest.mark.parametrize(("script", "outcome", "status"), [
    (lambda p, mid: p.reject(mid), "dead_lettered", StatusCode.ERROR),  # max attempts 1: rejected is dead
    (lambda p, mid: p.fail_unavailable(), "broker_unavailable", StatusCode.ERROR),
    (lambda p, mid: None, "published", StatusCode.UNSET),
])
def test_the_relay_span_ends_with_the_rows_outcome(exporter: InMemorySpanExporter, tiny: Outbox,
                                                   script: Callable[[InMemoryPublisher, str], None], outcome: str,
                                                   status: StatusCode) -> None:
    # Given a row and a broker scripted to reject it, to be unreachable, or to take it
    tiny.settings = tiny.settings.replace(relay_max_attempts=1)
    with tiny.sessions()() as s:
        row = tiny.publish(s, Event("Ping", {"n": 1}))
        s.commit()
        message_id = str(row.message_id)
    publisher = InMemoryPublisher()
    script(publisher, message_id)
    # When the relay runs one batch
    drain(tiny, publisher, max_batches=1)
    # Then its span says what happened to the row
    (span,) = named(exporter.get_finished_spans(), "publish Ping")
    assert span.attributes is not None and span.attributes["outbox.outcome"] == outcome
    assert span.attributes["messaging.message.id"] == message_id
    assert span.status.status_code is status


def test_a_span_current_in_another_trace_is_linked_not_the_parent(exporter: InMemorySpanExporter,
                                                                    tiny: Outbox) -> None:
    # Given a relayed Pong written inside a job's span
    with otel_trace.get_tracer("test").start_as_current_span("job"), tiny.sessions()() as s:
        tiny.publish(s, Event("Pong", {"n": 1}))
        s.commit()
    (message,) = drain(tiny).published
    # When it is delivered while a span of another trace is current (Celery's instrumentation's task span)
    with otel_trace.get_tracer("test").start_as_current_span("run/consumers.pong", context=Context()) as task:
        assert deliver_message(tiny, message) is Outcome.PROCESSED
    # Then the consumer's span continues the envelope's trace and links to the task's span
    spans = exporter.get_finished_spans()
    (relay,) = named(spans, "publish Pong")
    (consumer,) = named(spans, "process pong")
    assert parent_of(consumer) == relay.context.span_id
    assert [link.context.span_id for link in consumer.links] == [task.get_span_context().span_id]


@pytest.mark.parametrize("hostile", [
    123, ["00-" + "1" * 32 + "-" + "2" * 16 + "-01"], "garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01",
    "00-" + "a" * 32 + "-" + "b" * 16 + "-01" + " " * 20000, None,
])
def test_hostile_trace_headers_in_an_envelope_never_break_a_delivery(exporter: InMemorySpanExporter, tiny: Outbox,
                                                                     hostile: Any) -> None:
    # Given an envelope whose trace headers are not a usable context
    envelope = Envelope(message_id=uuid.uuid4(), type="Pong", payload={"n": 1},
                        headers={"traceparent": hostile, "tracestate": hostile, "baggage": hostile})
    message = celery_task_message(envelope, consumer="pong", routing_key="x")
    # When it is delivered
    outcome = deliver_message(tiny, message)
    # Then it is processed, under a span that starts a trace of its own
    assert outcome is Outcome.PROCESSED
    (span,) = named(exporter.get_finished_spans(), "process pong")
    assert span.parent is None and span.context.trace_id != 0


def test_the_writer_adds_the_context_only_inside_a_span(exporter: InMemorySpanExporter, tiny: Outbox) -> None:
    # Given tracing configured
    with tiny.sessions()() as s:
        # When one event is written outside any span and one inside
        tiny.publish(s, Event("Ping", {"n": 1}))
        with otel_trace.get_tracer("test").start_as_current_span("job") as job:
            tiny.publish(s, Event("Ping", {"n": 2}))
        s.commit()
    outside, inside = row_headers(tiny.sessions(), tiny.tables)
    # Then only the second carries it
    assert "traceparent" not in outside
    ctx = job.get_span_context()
    assert ids(inside["traceparent"]) == traceparent(ctx.trace_id, ctx.span_id)


class Greedy(TextMapPropagator):
    """A propagator that would write over the outbox's own headers."""

    def extract(self, carrier: CarrierT, context: Context | None = None, getter: Any = None) -> Context:
        return context or Context()

    def inject(self, carrier: CarrierT, context: Context | None = None,
               setter: Setter[CarrierT] = default_setter) -> None:
        setter.set(carrier, "correlation_id", "overwritten")
        setter.set(carrier, "traceparent", "from-greedy")

    @property
    def fields(self) -> set[str]:
        return {"correlation_id", "traceparent"}


def test_the_writer_never_overwrites_the_outboxs_own_headers(exporter: InMemorySpanExporter, tiny: Outbox,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a configured propagator that writes a header the outbox owns
    monkeypatch.setattr(propagate, "_HTTP_TEXT_FORMAT", Greedy())
    # When an event with a correlation id is written inside a span
    with otel_trace.get_tracer("test").start_as_current_span("job"), tiny.sessions()() as s:
        tiny.publish(s, Event("Ping", {"n": 1}, correlation_id="mine"))
        s.commit()
    # Then the outbox's header is kept and the propagator's other field is added
    (headers,) = row_headers(tiny.sessions(), tiny.tables)
    assert headers["correlation_id"] == "mine" and headers["traceparent"] == "from-greedy"


def test_the_trace_context_never_makes_an_event_refused(exporter: InMemorySpanExporter, tiny: Outbox) -> None:
    # Given a size limit the event's message meets exactly without the trace context (the relay's measure)
    event = Event("Ping", {"n": 1, "pad": "x" * 500}, correlation_id="c")
    envelope = Envelope(message_id=event.message_id, type=event.type, payload=event.payload,
                        headers=event.headers(), created_at_ms=tiny.clock.now_ms())
    (bare,) = celery_task_messages(envelope, targets=[("ping", "q")])
    size = len(bare.body.encode())
    tiny.settings = tiny.settings.replace(max_message_bytes=size)
    # When it is written inside a span
    with otel_trace.get_tracer("test").start_as_current_span("job"), tiny.sessions()() as s:
        tiny.publish(s, event)
        s.commit()
    # Then it is written, without the context that would not fit
    (headers,) = row_headers(tiny.sessions(), tiny.tables)
    assert headers == {"correlation_id": "c"}


def test_the_relays_context_never_makes_a_row_unpublishable(exporter: InMemorySpanExporter, tiny: Outbox) -> None:
    # Given a row written outside any span whose message meets the size limit exactly without a trace context
    with tiny.sessions()() as s:
        row = tiny.publish(s, Event("Pong", {"n": 1, "pad": "x" * 500}))
        s.commit()
        envelope = Envelope(message_id=row.message_id, type=row.type, payload=row.payload, headers=row.headers,
                            created_at_ms=row.created_at_ms)
    (bare,) = celery_task_messages(envelope, targets=[("pong", "q")])
    tiny.settings = tiny.settings.replace(max_message_bytes=len(bare.body.encode()))
    # When the relay publishes it (its span would add a context to the envelope)
    publisher = drain(tiny)
    # Then it is published as it is, not dead-lettered, and its span says so
    (message,) = publisher.published
    assert message.body == bare.body
    (span,) = named(exporter.get_finished_spans(), "publish Pong")
    assert span.attributes is not None and span.attributes["outbox.outcome"] == "published"


def test_without_a_tracer_provider_nothing_is_traced(tiny: Outbox) -> None:
    # Given OpenTelemetry installed but no SDK tracer provider configured
    assert isinstance(otel_trace.get_tracer_provider(), otel_trace.ProxyTracerProvider)
    assert not tracing.enabled()
    assert tracing.relay_spans([], routes={}, namespace="x") is tracing.NO_RELAY_SPANS
    # When an event is written and delivered inside a (no-op) span
    with otel_trace.get_tracer("test").start_as_current_span("job"), tiny.sessions()() as s:
        tiny.publish(s, Event("Pong", {"n": 1}))
        s.commit()
    publisher = drain(tiny)
    # Then no trace header is written or sent, and the delivery works
    assert [set(h) for h in row_headers(tiny.sessions(), tiny.tables)] == [{"correlation_id"}]
    assert set(envelope_headers(publisher.published[0])) == {"correlation_id"}
    assert deliver_message(tiny, publisher.published[0]) is Outcome.PROCESSED
    with tracing.consuming(consumer="c", destination="d", message_id="m", event_type="t", headers={}) as span:
        assert span is tracing.NO_CONSUMER_SPAN


def test_without_a_tracer_provider_a_worker_delivery_reads_nothing_of_its_request() -> None:
    # Given no SDK tracer provider, and a Celery request that records every attribute read of it
    assert not tracing.enabled()
    read: list[str] = []

    class Request:
        def __getattr__(self, name: str) -> Any:
            read.append(name)
            return None

    # When a delivery runs inside the worker's block for that request
    with tracing.worker_message(Request()), tracing.consuming(
            consumer="c", destination="d", message_id="m", event_type="t", headers={}) as span:
        assert span is tracing.NO_CONSUMER_SPAN
    # Then nothing of the request was read (the cost without a tracer is the one check)
    assert read == []


ABSENT = r"""
import sys
sys.modules["opentelemetry"] = None  # any "import opentelemetry..." now raises ImportError
import json
from pathlib import Path
from celeryconfig import Settings
from celery_outbox import tracing
from celery_outbox.testing import run_pending
from relay.web import create_app
from relay.factory import create_outbox

settings = Settings(home=Path(sys.argv[2]), database_url=sys.argv[1], namespace="absent", broker_url="memory://")
app = create_app(settings=settings)
order = {"order_id": "o-1", "customer_id": "c-1", "email": "a@example.com",
         "lines": [{"sku": "s", "quantity": 1, "unit_price_cents": 1}]}
response = app.test_client().post("/orders", json=order)
outcomes = run_pending(create_outbox(settings))
print(json.dumps({"status": response.status_code, "enabled": tracing.enabled(),
                  "outcomes": {k: [o.value for o in v] for k, v in outcomes.items()},
                  "otel": [m for m in sys.modules if m.startswith("opentelemetry.")]}))
"""


def test_everything_works_without_opentelemetry_installed(sqlite_url: str, tmp_home: Path) -> None:
    # Given an interpreter in which every opentelemetry import fails
    # When an order is posted to the web app, relayed and handled by every consumer
    out = subprocess.run([sys.executable, "-c", ABSENT, sqlite_url, str(tmp_home)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # Then it all worked, with tracing off and nothing of OpenTelemetry loaded
    assert result["status"] == 201
    assert result["enabled"] is False and result["otel"] == []
    assert result["outcomes"] and all(v == ["processed"] for v in result["outcomes"].values())
