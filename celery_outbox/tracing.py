"""OpenTelemetry across the outbox: one trace shows request -> relay -> consumer.

The only module that knows OpenTelemetry, and only through its API (the optional extra ``[otel]``,
imported on first use). It is off by default: without ``opentelemetry`` installed every function
here is a no-op, and with it installed but no SDK tracer provider configured the only cost is one
check (the current span for the writer, the global provider for relay and consumer).

- **writer** (``writer.outbox_values``, shared by ``Outbox.publish`` and the Django writer):
  ``traced_headers`` adds the current trace context to the event's headers, through the configured
  propagator (W3C ``traceparent``/``tracestate`` by default). It never overwrites the outbox's own
  headers, and never makes an event refused: when the context would push it over the size limit,
  the event is written without it.
- **task enqueue** (``celery.enqueue``): a task sent with ``.delay()`` through the outbox carries the
  current trace context in its Celery message headers (``traced_headers`` on the task headers).
- **relay** (``relay.dispatch``): ``relay_spans`` opens one PRODUCER span per claimed row, a child
  of the context the row was written in, and the envelope the consumers receive (a task row: the
  task's message headers) carries that span's context instead; the span names the row's real
  destination (a consumer's queue, a task's own queue). The spans end with the row's outcome
  (published, failed, dead-lettered, broker unavailable). A row the context would make
  unpublishable (over the size limit) goes without it. Celery's own instrumentation on the worker
  continues a plain task's trace from those headers.
- **consumer** (``delivery.deliver``): ``consuming`` opens the CONSUMER span of one delivery, a
  child of the context in the envelope's headers (the relay's span), current while the handler runs
  (an event it publishes continues the trace), ending with the delivery's outcome. Envelope headers
  are untrusted: only string values of a bounded length reach the propagator. A span already
  current in another trace (Celery's own instrumentation, whose task headers the outbox's strategy
  does not carry) is kept as a link. On a worker (``worker_message``, set by the consumer and
  ``@outbox.task`` tasks), the span names the queue the message really came from, and an
  ``@outbox.task`` run continues the trace its task message carries.
- **tracer providers** (``Settings.tracer_provider``, ``OUTBOX_TRACER_PROVIDER=module:function``):
  one hook for every process: the ``Outbox`` calls it where it is built (web, ``outbox relay``,
  ``celery beat``) and again in each Celery worker pool process after the fork (``celery/tracing_hook.py``).

Nothing here may fail the work it observes: an error inside OpenTelemetry is logged and ignored, and
trace headers are optional metadata. An unusable one (``TRACE_HEADERS``: not text, over
``HEADER_MAX_CHARS``, a NUL or a lone surrogate) is never a reason to refuse or dead-letter a message:
the task rule table drops it from a task message at both doors (``task_rules``), ``DroppedTraceHeaders``
counts it and logs the first, and the task runs without it (a new trace); an envelope's is not read
(``SafeGetter``) and the delivery runs. docs/operations.md ("Tracing") says the same.

One module, though long: it is the only one that knows OpenTelemetry, so the optional import, the no-op
fallbacks and the rule that nothing here may fail the work it observes are read and checked in one place.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer, TracerProvider

from celery_outbox.config.masking import mask_secrets
from celery_outbox.messages import is_storable

log = logging.getLogger("celery_outbox.tracing")

TRACER_NAME = "celery_outbox"
TASK_KIND = "task"  # messages.TASK_KIND: a row holding a Celery task message (its headers in "task_headers")
MESSAGING_SYSTEM = "celery"  # every outbox message is a Celery task message (messages.py)
HEADER_MAX_CHARS = 8192  # longest header value handed to the propagator (W3C baggage's own limit)
# The headers the default propagators read (W3C trace context and baggage): optional metadata.
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")


def unusable_trace_headers(headers: Mapping[str, Any]) -> tuple[str, ...]:
    """The trace headers of ``headers`` no propagator can use and no database column stores: not text,
    longer than ``HEADER_MAX_CHARS``, or holding a NUL or a lone surrogate (module docstring)."""
    return tuple(name for name in TRACE_HEADERS if name in headers and not (
        isinstance(value := headers[name], str) and len(value) <= HEADER_MAX_CHARS and is_storable(value)))


class DroppedTraceHeaders:
    """How many messages one door (the worker's gate, the enqueue capture) dropped an unusable trace header
    of; the first is logged, the rest only counted (a flood of them must not flood the log)."""

    def __init__(self, *, where: str) -> None:
        self.where = where
        self.count = 0

    def note(self, names: Sequence[str], *, task: str) -> None:
        self.count += 1
        if self.count == 1:
            log.warning("outbox: %s dropped unusable trace header(s) %s of a %r message (not text, too long, or a "
                        "NUL or lone surrogate); the task runs without them. Tracing is optional: later ones are "
                        "counted, not logged", self.where, ", ".join(names), task[:200])


class _Api:
    """The OpenTelemetry API modules, once imported."""

    def __init__(self) -> None:
        from opentelemetry import propagate, trace
        from opentelemetry.propagators.textmap import Getter

        class SafeGetter(Getter[Mapping[str, Any]]):
            """Reads untrusted headers: only string values of at most ``HEADER_MAX_CHARS``."""

            def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
                value = carrier.get(key)
                return [value] if isinstance(value, str) and len(value) <= HEADER_MAX_CHARS else None

            def keys(self, carrier: Mapping[str, Any]) -> list[str]:
                return [k for k in carrier if isinstance(k, str)]

        self.trace = trace
        self.propagate = propagate
        self.getter = SafeGetter()
        self.tracer: tuple[TracerProvider, Tracer] | None = None


_API: _Api | None = None
_LOADED = False


def preload() -> None:
    """Import the OpenTelemetry API now (if installed) rather than at the first message or publish."""
    _api()


def _api() -> _Api | None:
    """The API, or None when ``opentelemetry`` is not installed (or cannot be imported)."""
    global _API, _LOADED
    if not _LOADED:
        try:
            _API = _Api()
        except ImportError:
            _API = None
        except Exception:  # a broken install must not break publishing: trace nothing, say why once
            log.warning("opentelemetry cannot be imported; tracing is off", exc_info=True)
            _API = None
        _LOADED = True
    return _API


def _tracer(api: _Api) -> Tracer | None:
    """The library's tracer, or None when no SDK tracer provider is configured (tracing is off)."""
    provider = api.trace.get_tracer_provider()
    if isinstance(provider, (api.trace.ProxyTracerProvider, api.trace.NoOpTracerProvider)):
        return None
    cached = api.tracer
    if cached is None or cached[0] is not provider:
        cached = api.tracer = (provider, provider.get_tracer(TRACER_NAME))
    return cached[1]


def enabled() -> bool:
    """True when spans are recorded: OpenTelemetry is installed and a tracer provider is configured."""
    api = _api()
    return api is not None and _tracer(api) is not None


def _text(value: Any, limit: int = 200) -> str | None:
    return value[:limit] if isinstance(value, str) else None


# -- propagation ------------------------------------------------------------------------------------
def _extract(api: _Api, headers: Mapping[str, Any]) -> Context:
    """The context carried by untrusted ``headers``: only bounded string values are read."""
    context: Context = api.propagate.extract(headers if isinstance(headers, Mapping) else {}, getter=api.getter)
    return context


def _with_context(api: _Api, headers: Mapping[str, Any], context: Context | None,
                  replace: bool) -> dict[str, Any]:
    """``headers`` plus the trace fields of ``context`` (the current one when None). With ``replace``,
    the propagator's fields already in ``headers`` give way; otherwise no existing key is overwritten."""
    carrier: dict[str, str] = {}
    api.propagate.inject(carrier, context=context)
    out = dict(headers)
    if replace:
        for name in api.propagate.get_global_textmap().fields:
            out.pop(name, None)
    for key, value in carrier.items():
        if isinstance(key, str) and isinstance(value, str) and key not in out:
            out[key] = value
    return out


def traced_headers(headers: dict[str, Any]) -> dict[str, Any]:
    """``headers`` with the current trace context added (a new dict), or ``headers`` itself when there
    is no valid current span (always so without OpenTelemetry or an SDK)."""
    api = _api()
    if api is None:
        return headers
    try:
        if not api.trace.get_current_span().get_span_context().is_valid:
            return headers
        return _with_context(api, headers, None, replace=False)
    except Exception:
        log.debug("could not add the trace context to an event", exc_info=True)
        return headers


def _carrier(headers: Mapping[str, Any]) -> Mapping[str, Any]:
    """Where a row's trace context lives: a task row's Celery message headers, an event row's own headers."""
    if isinstance(headers, Mapping) and headers.get("outbox_kind") == TASK_KIND \
            and isinstance(headers.get("task_headers"), Mapping):
        task_headers: Mapping[str, Any] = headers["task_headers"]
        return task_headers
    return headers if isinstance(headers, Mapping) else {}


def _destination(row: _Row, routes: Mapping[str, Sequence[str]], namespace: str) -> list[str]:
    """The queues a row goes to: a task's own queue (as Celery routed it), an event's consumers' queues."""
    headers = row.headers if isinstance(row.headers, Mapping) else {}
    if headers.get("outbox_kind") == TASK_KIND:
        queue = headers.get("queue")
        name = queue.get("name") if isinstance(queue, Mapping) else None
        found = _text(name) or _text(headers.get("routing_key"))
        return [found] if found else []
    return [f"{namespace}.{c}" for c in routes.get(row.type, ())]


# -- relay ------------------------------------------------------------------------------------------
class _Row(Protocol):
    @property
    def message_id(self) -> Any: ...
    @property
    def type(self) -> str: ...
    @property
    def headers(self) -> dict[str, Any]: ...
    @property
    def seq(self) -> int: ...
    @property
    def attempts(self) -> int: ...


class _Built(Protocol):
    @property
    def unpublishable(self) -> Mapping[int, str]: ...


R = TypeVar("R", bound=_Row)
B = TypeVar("B", bound=_Built)


class RelaySpans:
    """The PRODUCER spans of one relay batch, one per claimed row (see the module docstring).

    Without tracing this is ``NO_RELAY_SPANS``: ``build`` calls ``make(rows)`` and the rest do nothing.
    """

    def __init__(self, api: _Api | None = None, spans: Sequence[tuple[Span, Context]] = ()) -> None:
        self._api = api
        self._spans = list(spans)
        self._open = bool(spans)

    def build(self, rows: Sequence[R], make: Callable[[list[R]], B]) -> B:
        """``make`` the batch's messages from ``rows`` whose headers carry their relay span's context;
        a row that this makes unpublishable (too large) is built again without it."""
        if self._api is None or not self._spans:
            return make(rows if isinstance(rows, list) else list(rows))
        traced = [self._traced(i, row) for i, row in enumerate(rows)]
        built = make(traced)
        worse = [i for i in built.unpublishable if traced[i] is not rows[i]]
        if worse:
            for i in worse:
                traced[i] = rows[i]
            built = make(traced)
        return built

    def _traced(self, i: int, row: R) -> R:
        assert self._api is not None
        span, parent = self._spans[i]
        try:
            context = self._api.trace.set_span_in_context(span, parent)
            if _carrier(row.headers) is not row.headers:  # a task row: the worker reads the task's headers
                task_headers = _with_context(self._api, _carrier(row.headers), context, replace=True)
                headers = {**row.headers, "task_headers": task_headers}
            else:
                headers = _with_context(self._api, row.headers, context, replace=True)
        except Exception:
            log.debug("could not add the relay's trace context to row %s", row.seq, exc_info=True)
            return row
        return dataclasses.replace(row, headers=headers)  # type: ignore[type-var]

    def finish(self, *, rejected: Mapping[int, tuple[_Row, str]], dead_now: Mapping[int, tuple[_Row, str]],
               max_attempts: int) -> None:
        """End every span with its row's outcome after the batch is marked."""
        if not self._open:
            return
        self._open = False
        for i, (span, _parent) in enumerate(self._spans):
            if i in dead_now:
                self._end(span, "dead_lettered", dead_now[i][1])
            elif i in rejected:
                row, error = rejected[i]
                self._end(span, "dead_lettered" if row.attempts + 1 >= max_attempts else "failed", error)
            else:
                self._end(span, "published", None)

    def fail(self, outcome: str, error: str) -> None:
        """End every span still open: the batch did not complete (``outcome`` says how)."""
        if not self._open:
            return
        self._open = False
        for span, _parent in self._spans:
            self._end(span, outcome, error)

    def _end(self, span: Span, outcome: str, error: str | None) -> None:
        assert self._api is not None
        try:
            span.set_attribute("outbox.outcome", outcome)
            if error is not None:
                span.set_status(self._api.trace.Status(self._api.trace.StatusCode.ERROR, error[:500]))
            span.end()
        except Exception:
            log.debug("could not end a relay span", exc_info=True)


NO_RELAY_SPANS = RelaySpans()


def relay_spans(rows: Sequence[_Row], *, routes: Mapping[str, Sequence[str]], namespace: str) -> RelaySpans:
    """Start the PRODUCER span of each claimed row (``NO_RELAY_SPANS`` when tracing is off)."""
    api = _api()
    tracer = _tracer(api) if api is not None else None
    if api is None or tracer is None or not rows:
        return NO_RELAY_SPANS
    spans: list[tuple[Span, Context]] = []
    try:
        for row in rows:
            parent = _extract(api, _carrier(row.headers))
            queues = _destination(row, routes, namespace)
            attributes: dict[str, Any] = {
                "messaging.system": MESSAGING_SYSTEM, "messaging.operation.type": "send",
                "messaging.operation.name": "publish", "messaging.message.id": str(row.message_id),
                "messaging.destination.name": ",".join(queues), "outbox.event_type": row.type,
                "outbox.seq": row.seq, "outbox.attempts": row.attempts, "outbox.consumers": queues,
            }
            correlation = _text(row.headers.get("correlation_id"))
            if correlation is not None:
                attributes["messaging.message.conversation_id"] = correlation
            span = tracer.start_span(f"publish {row.type}", context=parent, kind=api.trace.SpanKind.PRODUCER,
                                     attributes=attributes)
            spans.append((span, parent))
    except Exception:
        log.debug("could not start the relay's spans", exc_info=True)
        for span, _ in spans:
            span.end()
        return NO_RELAY_SPANS
    return RelaySpans(api, spans)


# -- consumer ---------------------------------------------------------------------------------------
class ConsumerSpan:
    """The CONSUMER span of one delivery; ``NO_CONSUMER_SPAN`` (does nothing) when tracing is off."""

    def __init__(self, api: _Api | None = None, span: Span | None = None) -> None:
        self._api = api
        self._span = span

    def record(self, outcome: str, *, deliveries: int, error: str | None = None, failed: bool = False) -> None:
        """Set the delivery's outcome; ``failed`` marks the span as an error with ``error``."""
        if self._api is None or self._span is None:
            return
        try:
            self._span.set_attribute("outbox.outcome", outcome)
            self._span.set_attribute("outbox.deliveries", deliveries)
            if failed:
                self._span.set_status(self._api.trace.Status(self._api.trace.StatusCode.ERROR, (error or outcome)[:500]))
        except Exception:
            log.debug("could not record a delivery's outcome on its span", exc_info=True)


NO_CONSUMER_SPAN = ConsumerSpan()


_NOT_CONSUMING: AbstractContextManager[ConsumerSpan] = nullcontext(NO_CONSUMER_SPAN)  # reusable: holds no state


def consuming(*, consumer: str, destination: str, message_id: str, event_type: Any,
              headers: Mapping[str, Any]) -> AbstractContextManager[ConsumerSpan]:
    """The delivery's CONSUMER span, current inside the block (``NO_CONSUMER_SPAN`` when off: one check)."""
    api = _api()
    tracer = _tracer(api) if api is not None else None
    if api is None or tracer is None:
        return _NOT_CONSUMING
    return _consuming(api, tracer, consumer=consumer, destination=destination, message_id=message_id,
                      event_type=event_type, headers=headers)


@contextmanager
def _consuming(api: _Api, tracer: Tracer, *, consumer: str, destination: str, message_id: str, event_type: Any,
               headers: Mapping[str, Any]) -> Iterator[ConsumerSpan]:
    request = _WORKER.get()
    worker = _worker_message(api, request) if request is not None else None
    if worker is not None:
        destination = worker.destination or destination
    try:
        parent: Context | None = _extract(api, headers)
        if worker is not None and worker.headers and not api.trace.get_current_span(parent).get_span_context().is_valid:
            parent = _extract(api, worker.headers)  # an @outbox.task run: the trace its task message carries
        links = []
        theirs = api.trace.get_current_span(parent).get_span_context()
        current = api.trace.get_current_span().get_span_context()
        if not theirs.is_valid:
            parent = None  # no context in the envelope: a child of whatever is current
        elif current.is_valid and current.trace_id != theirs.trace_id:
            links.append(api.trace.Link(current))
        attributes: dict[str, Any] = {
            "messaging.system": MESSAGING_SYSTEM, "messaging.operation.type": "process",
            "messaging.operation.name": "process", "messaging.destination.name": destination,
            "messaging.consumer.group.name": consumer, "messaging.message.id": message_id,
            "outbox.consumer": consumer,
        }
        kind = _text(event_type)
        if kind is not None:
            attributes["outbox.event_type"] = kind
        correlation = _text(headers.get("correlation_id")) if isinstance(headers, Mapping) else None
        if correlation is not None:
            attributes["messaging.message.conversation_id"] = correlation
        span = tracer.start_span(f"process {consumer}", context=parent, kind=api.trace.SpanKind.CONSUMER,
                                 attributes=attributes, links=links)
    except Exception:
        log.debug("could not start a delivery's span", exc_info=True)
        yield NO_CONSUMER_SPAN
        return
    with api.trace.use_span(span, end_on_exit=True, record_exception=True, set_status_on_exception=True):
        yield ConsumerSpan(api, span)


# -- worker -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _WorkerMessage:
    destination: str | None
    headers: Mapping[str, Any]


# The Celery request of the task running in this context (``worker_message``); read only by a span.
_WORKER: ContextVar[Any] = ContextVar("celery_outbox_worker_message", default=None)


class _WorkerBlock:
    """``worker_message``'s block: only remembers the request (no generator, nothing read from it)."""

    __slots__ = ("_request", "_token")

    def __init__(self, request: Any) -> None:
        self._request = request

    def __enter__(self) -> None:
        self._token = _WORKER.set(self._request)

    def __exit__(self, *exc: object) -> None:
        _WORKER.reset(self._token)


def worker_message(request: Any) -> AbstractContextManager[None]:
    """Inside this block a delivery's span names the queue Celery's ``request`` came from (its routing
    key: every outbox queue is bound under its own name) and may continue the trace in its headers.

    The request is read when a delivery's span starts (``consuming``), so without a tracer this block
    reads nothing and costs one context variable set and reset."""
    return _WorkerBlock(request)


def _worker_message(api: _Api, request: Any) -> _WorkerMessage:
    """What a span reads of the running task's Celery ``request``: its queue and its trace context."""
    try:
        info = getattr(request, "delivery_info", None) or {}
        destination = _text(info.get("routing_key")) if isinstance(info, Mapping) else None
    except Exception:
        destination = None
    headers: dict[str, str] = {}
    try:
        given = getattr(request, "headers", None)  # an eager run's headers; a worker's are attributes
        given = given if isinstance(given, Mapping) else {}
        for name in api.propagate.get_global_textmap().fields:
            value = getattr(request, name, None)
            value = value if value is not None else given.get(name)
            if isinstance(value, str) and len(value) <= HEADER_MAX_CHARS:
                headers[name] = value
    except Exception:
        log.debug("could not read the trace context of a task request", exc_info=True)
    return _WorkerMessage(destination=destination or None, headers=headers)


# -- tracer providers ----------------------------------------------------------------------------------
def install_tracer_provider(factory: Callable[[], Any]) -> bool:
    """Make ``factory()`` the global tracer provider unless one is already set in this process (OpenTelemetry
    allows it once per process); True when it was installed here. Never raises: tracing stays off."""
    api = _api()
    if api is None:
        return False
    try:
        if not isinstance(api.trace.get_tracer_provider(), api.trace.ProxyTracerProvider):
            return False
        api.trace.set_tracer_provider(factory())
        return True
    except Exception as e:  # one line (masked: the hook's text may hold a URL); the traceback only at debug level
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:300]
        log.warning("the tracer provider hook failed (%s%s); tracing is off in this process", type(e).__name__,
                    f": {mask_secrets(first)}" if first else "")
        log.debug("the tracer provider hook's traceback", exc_info=True)
        return False
