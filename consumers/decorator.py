"""The idempotent-consumer decorator and the registry the Celery integration reads.

``@consumer(name="shipping", event="OrderPlaced")`` turns a handler ``(session, envelope) -> None``
into a ``ConsumerSpec`` (still callable as the handler). A ``ConsumerRegistry`` collects specs; it is
built by a function (``default_registry()``), never held in a module-level global, so tests and
apps can build their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

from sqlalchemy.orm import Session

from consumers import inbox
from consumers.inbox import CrashSite, Handler, Prepare
from consumers.outcome import Outcome
from outbox.clock import Clock
from outbox.errors import ConfigError, UnknownEventTypeError
from outbox.messages import Envelope


@dataclass(frozen=True, kw_only=True)
class ConsumerSpec:
    """One consumer: its name (queue and inbox key), the events it accepts, its effect."""

    name: str
    events: frozenset[str]
    handler: Handler
    prepare: Prepare | None = None
    ordering: bool = False
    fast_path: bool = True

    def __call__(self, session: Session, envelope: Envelope) -> None:
        self.handler(session, envelope)

    def accepts(self, event_type: str) -> bool:
        return event_type in self.events

    def handle(self, session: Session, envelope: Envelope, *, clock: Clock, crash_points: CrashSite | None = None,
               fast_path: bool | None = None) -> Outcome:
        """``inbox.handle`` with this consumer's options; an event it does not accept is an error."""
        if not self.accepts(envelope.type):
            raise UnknownEventTypeError(
                f"consumer {self.name!r} does not handle event type {envelope.type!r} "
                f"(it handles: {', '.join(sorted(self.events))})"
            )
        return inbox.handle(session, envelope, consumer=self.name, handler=self.handler, clock=clock,
                            fast_path=self.fast_path if fast_path is None else fast_path,
                            ordering=self.ordering, crash_points=crash_points, prepare=self.prepare)


def consumer(*, name: str, event: str | Iterable[str], ordering: bool = False, fast_path: bool = True,
             prepare: Prepare | None = None) -> Callable[[Handler], ConsumerSpec]:
    """Declare ``handler`` as the idempotent consumer ``name`` of ``event`` (one type or several)."""
    events = frozenset([event] if isinstance(event, str) else event)
    if not name or not events:
        raise ConfigError("a consumer needs a name and at least one event type")

    def decorate(handler: Handler) -> ConsumerSpec:
        return ConsumerSpec(name=name, events=events, handler=handler, prepare=prepare, ordering=ordering,
                            fast_path=fast_path)

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

    def consumer(self, *, name: str, event: str | Iterable[str], ordering: bool = False, fast_path: bool = True,
                 prepare: Prepare | None = None) -> Callable[[Handler], ConsumerSpec]:
        """Like the module-level ``consumer`` decorator, and registers the spec here."""
        make = consumer(name=name, event=event, ordering=ordering, fast_path=fast_path, prepare=prepare)

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
        """A copy with options overridden on every spec (tests: the fast path switched off)."""
        specs = [s if fast_path is None else replace(s, fast_path=fast_path) for s in self]
        return ConsumerRegistry(specs=specs)


def default_registry() -> ConsumerRegistry:
    """A new registry with the shipped consumers: shipping, billing, search, email."""
    from consumers.billing import billing
    from consumers.email import email
    from consumers.search import search
    from consumers.shipping import shipping

    return ConsumerRegistry(specs=[shipping, billing, search, email])
