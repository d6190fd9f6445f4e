"""Consumer declarations: a name (queue, task and inbox key), the events it takes, its effect and policy.

``Outbox.consumer`` is the public way to declare one; it builds a ``ConsumerSpec`` with ``consumer()``
and keeps it in the outbox's ``ConsumerRegistry`` (never a module-level global).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

from sqlalchemy.orm import Session

from celery_outbox.clock import Clock
from celery_outbox.errors import ConfigError, UnknownEventTypeError
from celery_outbox.inbox import handle as inbox
from celery_outbox.inbox.batch import MAX_BATCH_SIZE, BatchHandler, handle_batch
from celery_outbox.inbox.claim import CrashSite, Handler, Prepare
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import TYPE_MAX_CHARS, Envelope
from celery_outbox.names import check_name
from celery_outbox.policy import RetryPolicy
from celery_outbox.schema import Tables

_Step = TypeVar("_Step")  # a batch consumer's handler (core) or effect (Django)


@dataclass(frozen=True, kw_only=True)
class ConsumerSpec:
    """One consumer: its name (queue and inbox key), the events it accepts, its effect."""

    name: str
    events: frozenset[str]
    handler: Handler
    prepare: Prepare | None = None
    ordering: bool = False
    fast_path: bool = True  # with ``prepare`` only: read the inbox before the external call (inbox/handle.py)
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    # A batch consumer (``batch_size`` set): ``batch_handler(session, envelopes)`` takes many messages at once,
    # and ``handler`` is it on a list of one (a retried message runs alone). See docs/tasks.md, "Batch consumers".
    batch_size: int | None = None
    batch_wait_ms: int = 0
    batch_handler: BatchHandler | None = None

    def __call__(self, session: Session, envelope: Envelope) -> None:
        self.handler(session, envelope)

    def accepts(self, event_type: str) -> bool:
        return event_type in self.events

    def handle(self, session: Session, envelope: Envelope, *, tables: Tables, clock: Clock, crash_points: CrashSite | None = None,
               fast_path: bool | None = None, park_timeout_ms: int | None = None) -> Outcome:
        """``inbox.handle`` with this consumer's options; an event it does not accept is an error.

        ``park_timeout_ms`` is passed (by ``delivery.deliver``) only to consumers with ``ordering``."""
        if not self.accepts(envelope.type):
            raise UnknownEventTypeError(
                f"consumer {self.name!r} does not handle event type {envelope.type!r} "
                f"(it handles: {', '.join(sorted(self.events))})"
            )
        return inbox.handle(session, envelope, tables=tables, consumer=self.name, handler=self.handler, clock=clock,
                            fast_path=self.fast_path if fast_path is None else fast_path,
                            ordering=self.ordering, crash_points=crash_points, prepare=self.prepare,
                            park_timeout_ms=park_timeout_ms)

    def batch_step(self, envelopes: list[Envelope], step: _Step | None) -> _Step:
        """``step`` (this batch consumer's handler or effect), once the batch is known to be one it can take,
        before anything is written: it is a batch consumer (``step`` is not None: declared with
        ``batch_size=...``) and every envelope is of an event type it handles."""
        if step is None:
            raise ConfigError(f"consumer {self.name!r} is not a batch consumer (declare it with batch_size=...)")
        for envelope in envelopes:
            if not self.accepts(envelope.type):
                raise UnknownEventTypeError(
                    f"consumer {self.name!r} does not handle event type {envelope.type!r} "
                    f"(it handles: {', '.join(sorted(self.events))})")
        return step

    def handle_batch(self, session: Session, envelopes: list[Envelope], *, tables: Tables, clock: Clock,
                     crash_points: CrashSite | None = None) -> list[Outcome]:
        """``inbox.batch.handle_batch`` with this batch consumer's handler: one outcome per envelope,
        PROCESSED or DUPLICATE; a handler exception rolls the whole batch back and propagates."""
        handler = self.batch_step(envelopes, self.batch_handler)
        return handle_batch(session, envelopes, tables=tables, consumer=self.name, handler=handler,
                            clock=clock, crash_points=crash_points)


DEFAULT_BATCH_WAIT_MS = 50
MAX_BATCH_WAIT_MS = 10_000


def check_batch(name: str, *, batch_size: int | None, batch_wait_ms: int | None, ordering: bool,
                prepare: object | None) -> tuple[int | None, int]:
    """Validate a batch consumer's options; returns ``(batch_size, batch_wait_ms)`` (``(None, 0)`` when it is
    not one). A per-entity ordered consumer or one with a ``prepare`` step cannot be a batch consumer: its
    bookkeeping is per message (docs/tasks.md, "Batch consumers")."""
    if batch_size is None:
        if batch_wait_ms is not None:
            raise ConfigError(f"consumer {name!r}: batch_wait_ms needs batch_size (a batch consumer)")
        return None, 0
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise ConfigError(f"consumer {name!r}: batch_size must be an integer from 1 to {MAX_BATCH_SIZE}, "
                          f"got {batch_size!r}")
    wait = DEFAULT_BATCH_WAIT_MS if batch_wait_ms is None else batch_wait_ms
    if isinstance(wait, bool) or not isinstance(wait, int) or not 0 <= wait <= MAX_BATCH_WAIT_MS:
        raise ConfigError(f"consumer {name!r}: batch_wait_ms must be an integer from 0 to {MAX_BATCH_WAIT_MS}, "
                          f"got {wait!r}")
    if ordering:
        raise ConfigError(f"consumer {name!r}: a per-entity ordered consumer (ordering=True) cannot take batch_size: "
                          f"it applies the versions of an entity one message at a time; drop one of the two")
    if prepare is not None:
        raise ConfigError(f"consumer {name!r}: a consumer with a prepare step cannot take batch_size: its external "
                          f"call is made per message, before the inbox transaction")
    return batch_size, wait


def _event_types(name: str, event: Any) -> frozenset[str]:
    """The event types a consumer declares: each one an event the writer accepts (non-empty printable text of at
    most ``TYPE_MAX_CHARS`` characters), else a ``ConfigError``: a consumer of a type no event can have would wait
    for ever without a word."""
    try:
        events: frozenset[Any] = frozenset([event] if isinstance(event, str) else event)
    except TypeError:  # not iterable (5, None), or holding unhashable items (a list of lists)
        events = frozenset()
    if not events or not all(isinstance(e, str) and e.strip() for e in events):
        raise ConfigError(f"consumer {name!r} needs at least one non-empty event type (text, or a list of them), "
                          f"got {type(event).__name__}")
    for e in events:
        check_event_type(e, owner=f"consumer {name!r}")
    return events


def check_event_type(event_type: str, *, owner: str) -> None:
    """An event type some event can have (the writer's rule): at most ``TYPE_MAX_CHARS`` printable characters."""
    if len(event_type) > TYPE_MAX_CHARS or not event_type.isprintable():
        raise ConfigError(f"{owner}: event type {repr(event_type)[:60]} must be at most {TYPE_MAX_CHARS} printable "
                          "characters (what an event's type can be)")


def consumer(*, name: str, event: str | Iterable[str], ordering: bool = False, fast_path: bool = True,
             prepare: Prepare | None = None, max_retries: int | None = None, retry_backoff: bool | float = True,
             retry_backoff_max: float | None = None, retry_jitter: bool = False, batch_size: int | None = None,
             batch_wait_ms: int | None = None) -> Callable[[Handler | BatchHandler], ConsumerSpec]:
    """Declare ``handler`` as the idempotent consumer ``name`` of ``event`` (one type or several).

    ``batch_size``: a batch consumer, ``handler(session, envelopes)`` taking up to that many messages that
    arrived within ``batch_wait_ms`` (50 by default); their inbox rows commit with its effect (``check_batch``).

    The retry options mean what they mean on ``@app.task`` (see ``RetryPolicy``). ``fast_path``
    matters only with ``prepare``: the inbox is read before the external call, so a message already
    handled does not call the provider again (the plain path needs no read: its claim reports the
    duplicate; see inbox/handle.py).
    """
    check_name(name)
    events = _event_types(name, event)
    policy = RetryPolicy(max_retries=max_retries, retry_backoff=retry_backoff, retry_backoff_max=retry_backoff_max,
                         retry_jitter=retry_jitter)
    if ordering and prepare is not None:
        raise ConfigError(f"consumer {name!r}: per-entity ordering cannot be combined with a prepare step")
    size, wait = check_batch(name, batch_size=batch_size, batch_wait_ms=batch_wait_ms, ordering=ordering,
                             prepare=prepare)

    def decorate(handler: Handler | BatchHandler) -> ConsumerSpec:
        if size is None:
            return ConsumerSpec(name=name, events=events, handler=cast(Handler, handler), prepare=prepare,
                                ordering=ordering, fast_path=fast_path, policy=policy)
        batch = cast(BatchHandler, handler)
        return ConsumerSpec(name=name, events=events, handler=one_at_a_time(batch), fast_path=fast_path,
                            policy=policy, batch_size=size, batch_wait_ms=wait, batch_handler=batch)

    return decorate


def one_at_a_time(batch: BatchHandler) -> Handler:
    """A batch handler as a one-message handler (a message delivered alone: a retry, an isolated failure)."""
    def handler(session: Session, envelope: Envelope) -> None:
        batch(session, [envelope])

    handler.__name__ = getattr(batch, "__name__", "batch_handler")
    handler.__qualname__ = getattr(batch, "__qualname__", handler.__name__)
    return handler


class ConsumerRegistry:
    """Consumer specs by name."""

    def __init__(self, *, specs: Iterable[ConsumerSpec] = ()) -> None:
        self._specs: dict[str, ConsumerSpec] = {}
        for spec in specs:
            self.add(spec)

    def add(self, spec: ConsumerSpec) -> ConsumerSpec:
        if spec.name in self._specs:
            raise ConfigError(f"consumer {spec.name!r} is registered twice")
        self._specs[spec.name] = spec
        return spec

    def consumer(self, *, name: str, event: str | Iterable[str],
                 **options: Any) -> Callable[[Handler | BatchHandler], ConsumerSpec]:
        """Like the module-level ``consumer`` decorator, and registers the spec here."""
        make = consumer(name=name, event=event, **options)

        def decorate(handler: Handler | BatchHandler) -> ConsumerSpec:
            return self.add(make(handler))

        return decorate

    def get(self, name: str) -> ConsumerSpec | None:
        return self._specs.get(name)

    def __getitem__(self, name: str) -> ConsumerSpec:
        spec = self._specs.get(name)
        if spec is None:
            raise KeyError(f"no consumer {name!r}; registered: {', '.join(self._specs) or '(none)'}")
        return spec

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[ConsumerSpec]:
        return iter(self._specs.values())

    def names(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def with_options(self, *, fast_path: bool | None = None) -> ConsumerRegistry:
        """A copy with options overridden on every spec (tests: the pre-check of ``prepare`` switched off)."""
        specs = [s if fast_path is None else replace(s, fast_path=fast_path) for s in self]
        return ConsumerRegistry(specs=specs)
