"""Consumer declarations: a name (queue, task and inbox key), the events it takes, its effect and policy.

``Outbox.consumer`` is the public way to declare one; it builds a ``ConsumerSpec`` with ``consumer()``
and keeps it in the outbox's ``ConsumerRegistry`` (never a module-level global).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy.orm import Session

from celery_outbox.clock import Clock
from celery_outbox.errors import ConfigError, UnknownEventTypeError
from celery_outbox.inbox import handle as inbox
from celery_outbox.inbox.claim import CrashSite, Handler, Prepare
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.names import check_name
from celery_outbox.policy import RetryPolicy
from celery_outbox.schema import Tables


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


def consumer(*, name: str, event: str | Iterable[str], ordering: bool = False, fast_path: bool = True,
             prepare: Prepare | None = None, max_retries: int | None = None, retry_backoff: bool | float = True,
             retry_backoff_max: float | None = None, retry_jitter: bool = False) -> Callable[[Handler], ConsumerSpec]:
    """Declare ``handler`` as the idempotent consumer ``name`` of ``event`` (one type or several).

    The retry options mean what they mean on ``@app.task`` (see ``RetryPolicy``). ``fast_path``
    matters only with ``prepare``: the inbox is read before the external call, so a message already
    handled does not call the provider again (the plain path needs no read: its claim reports the
    duplicate; see inbox/handle.py).
    """
    check_name(name)
    events = frozenset([event] if isinstance(event, str) else event)
    if not events or not all(isinstance(e, str) and e.strip() for e in events):
        raise ConfigError(f"consumer {name!r} needs at least one non-empty event type")
    policy = RetryPolicy(max_retries=max_retries, retry_backoff=retry_backoff, retry_backoff_max=retry_backoff_max,
                         retry_jitter=retry_jitter)
    if ordering and prepare is not None:
        raise ConfigError(f"consumer {name!r}: per-entity ordering cannot be combined with a prepare step")

    def decorate(handler: Handler) -> ConsumerSpec:
        return ConsumerSpec(name=name, events=events, handler=handler, prepare=prepare, ordering=ordering,
                            fast_path=fast_path, policy=policy)

    return decorate


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

    def consumer(self, *, name: str, event: str | Iterable[str], **options: Any) -> Callable[[Handler], ConsumerSpec]:
        """Like the module-level ``consumer`` decorator, and registers the spec here."""
        make = consumer(name=name, event=event, **options)

        def decorate(handler: Handler) -> ConsumerSpec:
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
