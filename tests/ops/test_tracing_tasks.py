"""Tracing of tasks sent with ``.delay()`` through the outbox: request -> relay -> worker in one trace, the
worker span naming the task's real queue, and one tracer-provider hook (``OUTBOX_TRACER_PROVIDER``) for
every process, the worker's pool processes included."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, signals
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.util._once import Once
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import ConfigError, ManualClock, Outbox, Settings, Tables
from celery_outbox.testing import InMemoryPublisher, run_pending
from tests.support.tracing import memory_tracer

BUILT: list[TracerProvider] = []


def make_provider() -> TracerProvider:
    """The team's hook (OUTBOX_TRACER_PROVIDER=tests.ops.test_tracing_tasks:make_provider)."""
    provider = TracerProvider()
    BUILT.append(provider)
    return provider


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    with memory_tracer(monkeypatch) as exporter:
        yield exporter


class Shop:
    def __init__(self, sessions: sessionmaker[Session], tables: Tables, **settings: Any) -> None:
        self.queue = f"mail-{uuid.uuid4().hex[:8]}"
        self.app = Celery("traced", broker="memory://localhost/", set_as_current=False)
        self.app.conf.task_routes = {"shop.*": {"queue": self.queue}}
        self.outbox = Outbox(self.app, session_factory=sessions, clock=ManualClock(),
                             settings=Settings.from_env({}, **settings))
        self.outbox._tables = tables
        self.sessions = sessions

        @self.outbox.task(name="shop.mail")
        def mail(session: Session, to: str) -> str:
            return to

        self.mail = mail


def test_a_delayed_task_is_one_trace_from_the_request_through_the_relay_to_the_worker(
        exporter: InMemorySpanExporter, sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    shop = Shop(sqlite_sessions, tables)
    tracer = otel_trace.get_tracer("test.web")
    # Given a request span in which the view sends a task through the outbox
    with tracer.start_as_current_span("POST /orders", kind=SpanKind.SERVER) as request, \
            shop.sessions.begin() as s, shop.outbox.transaction(s):
        shop.mail.delay("a@example.com")
    trace_id = request.get_span_context().trace_id
    # When the relay publishes it and a worker runs it (in this process)
    publisher = InMemoryPublisher()
    run_pending(shop.outbox, publisher)
    spans = exporter.get_finished_spans()
    [relay] = [sp for sp in spans if sp.kind is SpanKind.PRODUCER]
    [worker] = [sp for sp in spans if sp.kind is SpanKind.CONSUMER]
    # Then the relay's span is a child of the request, named for the task and its real queue
    assert relay.context.trace_id == trace_id and relay.parent is not None
    assert relay.parent.span_id == request.get_span_context().span_id
    assert relay.name == "publish shop.mail" and (relay.attributes or {}).get("messaging.destination.name") == shop.queue
    # And the task message the broker got carries the relay span's context (what Celery's instrumentation reads)
    [message] = publisher.tasks()
    assert message.headers["traceparent"].startswith(f"00-{trace_id:032x}-{relay.context.span_id:016x}")
    # And the worker's span continues it, naming the queue the message came from (not "<namespace>.<task key>")
    assert worker.context.trace_id == trace_id and worker.parent is not None
    assert worker.parent.span_id == relay.context.span_id
    assert (worker.attributes or {}).get("messaging.destination.name") == shop.queue


def test_without_a_span_the_task_row_carries_no_trace_context(exporter: InMemorySpanExporter,
                                                              sqlite_sessions: sessionmaker[Session],
                                                              tables: Tables) -> None:
    shop = Shop(sqlite_sessions, tables)
    with shop.sessions.begin() as s, shop.outbox.transaction(s):
        shop.mail.delay("a@example.com")
    publisher = InMemoryPublisher()
    run_pending(shop.outbox, publisher)
    # the relay's span starts the trace; the worker continues the relay's
    [relay] = [sp for sp in exporter.get_finished_spans() if sp.kind is SpanKind.PRODUCER]
    [worker] = [sp for sp in exporter.get_finished_spans() if sp.kind is SpanKind.CONSUMER]
    assert relay.parent is None and worker.parent is not None and worker.parent.span_id == relay.context.span_id


@pytest.fixture
def no_provider(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process where no tracer provider was set yet (OpenTelemetry allows setting it once)."""
    monkeypatch.setattr(otel_trace, "_TRACER_PROVIDER", None)
    monkeypatch.setattr(otel_trace, "_TRACER_PROVIDER_SET_ONCE", Once())
    BUILT.clear()
    yield
    for provider in BUILT:
        provider.shutdown()


HOOK = "tests.ops.test_tracing_tasks:make_provider"


def test_one_hook_installs_the_provider_where_the_outbox_is_built_and_in_each_pool_process(
        no_provider: None, sqlite_sessions: sessionmaker[Session], tables: Tables,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the operator's one setting, When the Outbox is built (web, relay, beat, a worker's main process)
    monkeypatch.setenv("OUTBOX_TRACER_PROVIDER", HOOK)
    shop = Shop(sqlite_sessions, tables, tracer_provider=HOOK)  # kept: the signal holds its hook weakly
    # Then it is this process's provider
    assert otel_trace.get_tracer_provider() is BUILT[0]
    # When a worker pool process starts without one (a parent that had none), Then it builds its own
    monkeypatch.setattr(otel_trace, "_TRACER_PROVIDER", None)
    monkeypatch.setattr(otel_trace, "_TRACER_PROVIDER_SET_ONCE", Once())
    signals.worker_process_init.send(sender=None)
    assert len(BUILT) == 2 and otel_trace.get_tracer_provider() is BUILT[1]
    # And a provider already set (by the team, or opentelemetry-instrument) is kept
    signals.worker_process_init.send(sender=None)
    assert len(BUILT) == 2 and shop.outbox.settings.tracer_provider == HOOK


def test_a_bad_hook_is_one_clear_error_at_start(no_provider: None, sqlite_sessions: sessionmaker[Session],
                                                tables: Tables) -> None:
    with pytest.raises(ConfigError, match=r"OUTBOX_TRACER_PROVIDER must be empty or module\.path:function"):
        Settings.from_env({}, tracer_provider="not a spec")
    with pytest.raises(ConfigError, match=r"cannot import 'tests\.ops\.nowhere'"):
        Shop(sqlite_sessions, tables, tracer_provider="tests.ops.nowhere:make")
    with pytest.raises(ConfigError, match="'absent' is not a function"):
        Shop(sqlite_sessions, tables, tracer_provider="tests.ops.test_tracing_tasks:absent")
    assert BUILT == []


def failing_hook() -> Any:
    """A hook that raises, its text holding a URL with a password."""
    raise RuntimeError("exporter at https://otel:hook-Pw-Never-Shown@collector:4318 refused\nsecond line")


def test_a_hook_that_raises_is_one_masked_warning_and_tracing_stays_off(
        no_provider: None, sqlite_sessions: sessionmaker[Session], tables: Tables,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given a hook that raises; When the Outbox is built
    with caplog.at_level(logging.WARNING, logger="celery_outbox.tracing"):
        Shop(sqlite_sessions, tables, tracer_provider="tests.ops.test_tracing_tasks:failing_hook")
    # Then the process runs on without tracing, with one warning line: no traceback, no password
    assert isinstance(otel_trace.get_tracer_provider(), otel_trace.ProxyTracerProvider)
    [record] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    message = record.getMessage()
    assert record.exc_info is None and "\n" not in message and "hook-Pw-Never-Shown" not in message, message
    assert "RuntimeError" in message and "tracing is off" in message
