"""How a setting is declared: ``name: type = setting(default, rule, doc=...)`` in a ``Settings`` body, and the
relations between settings.

The declaration is the dataclass field itself (its default and type), with an ``Option`` in its metadata
(its rule, why the bounds are what they are, a one-line doc, the brokers it means something on), so
``Settings.RULES``, the validation, the environment reading and docs/settings.md all come from it.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from celery_outbox.config.rules import Owner, Rule

OPTION = "celery_outbox.option"  # the key of a field's ``Option`` in its dataclass metadata
T = TypeVar("T")


@dataclass(frozen=True)
class Option:
    """Everything said about one setting besides its name, type and default (the dataclass field's)."""

    rule: Rule
    doc: str  # one line: what it does, for docs/settings.md
    why: str = ""  # why its bounds are what they are
    brokers: tuple[str, ...] = ()  # the brokers it means something on (empty: all)

    @property
    def secret(self) -> bool:
        return self.rule.secret


@dataclass(frozen=True)
class Redeclared:
    """A subclass's new default and doc for a setting its parent declared: the parent's rule stays."""

    doc: str
    brokers: tuple[str, ...] = ()


@overload
def setting(default: T, rule: Rule, *, doc: str, why: str = "", brokers: tuple[str, ...] = ()) -> T: ...


@overload
def setting(*, factory: Callable[[], T], rule: Rule, doc: str, why: str = "", brokers: tuple[str, ...] = ()) -> T: ...


def setting(default: Any = dataclasses.MISSING, rule: Rule | None = None, *, factory: Any = dataclasses.MISSING,
            doc: str, why: str = "", brokers: tuple[str, ...] = ()) -> Any:
    """Declare one setting in a ``Settings`` class body: ``name: type = setting(default, rule, doc=...)``.

    Returns the dataclass field (its ``Option`` in the field's metadata), typed as the default so the
    annotation is checked against it.
    """
    if rule is None:
        raise TypeError("setting() needs a rule; a subclass changing a parent's setting uses redeclare()")
    meta = {OPTION: Option(rule=rule, doc=doc, why=why, brokers=brokers)}
    return dataclasses.field(default=default, default_factory=factory, metadata=meta)


@overload
def redeclare(default: T, *, doc: str, brokers: tuple[str, ...] = ()) -> T: ...


@overload
def redeclare(*, factory: Callable[[], T], doc: str, brokers: tuple[str, ...] = ()) -> T: ...


def redeclare(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, doc: str,
              brokers: tuple[str, ...] = ()) -> Any:
    """In a subclass body: a parent's setting with this class's default and doc, checked by the parent's rule."""
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={OPTION: Redeclared(doc=doc, brokers=brokers)})


def declared_options(namespace: Mapping[str, Any], inherited: Mapping[str, Option], owner: str) -> dict[str, Option]:
    """The options a class body declares (``namespace``: its attributes, by name); a ``redeclare()`` is
    resolved against ``inherited``, the parents' options."""
    options: dict[str, Option] = {}
    for name, value in namespace.items():
        meta = value.metadata.get(OPTION) if isinstance(value, dataclasses.Field) else None
        if isinstance(meta, Option):
            options[name] = meta
        elif isinstance(meta, Redeclared):
            if name not in inherited:
                raise TypeError(f"{owner}: redeclare() of {name}, which no parent declares; use setting()")
            options[name] = dataclasses.replace(inherited[name], doc=meta.doc,
                                                brokers=meta.brokers or inherited[name].brokers)
    return options


_COMPARISONS: Mapping[str, tuple[Callable[[Any, Any], bool], str]] = {
    "<": (operator.lt, "must be below"),
    "<=": (operator.le, "must not exceed"),
    ">": (operator.gt, "must exceed"),
}
BROKER_NAMES: Mapping[str, str] = {"redis": "Redis", "rabbitmq": "RabbitMQ"}


def variable(name: str) -> str:
    """The environment variable of the setting ``name``."""
    return f"OUTBOX_{name.upper()}"


@dataclass(frozen=True)
class Relation:
    """``left op right`` between two settings (``right`` times ``scale``, in ``left``'s unit), checked once
    each passed its own rule; ``why`` is what goes wrong otherwise (in the error and in docs/settings.md)."""

    left: str
    op: str  # "<", "<=" or ">"
    right: str
    why: str
    scale: int = 1
    right_unit: str = ""  # shown after the right value in an error: " s" when scale turns seconds into ms

    def __post_init__(self) -> None:
        if self.op not in _COMPARISONS:
            raise TypeError(f"Relation {self.left} {self.op} {self.right}: op must be one of {', '.join(_COMPARISONS)}")

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.left, self.right)

    @property
    def where(self) -> str:
        """Where the relation applies, as the error and the docs say it ("" everywhere)."""
        return ""

    def compare(self, owner: Any) -> bool:
        """Whether the two values stand as the relation says (on any broker)."""
        return bool(_COMPARISONS[self.op][0](getattr(owner, self.left), getattr(owner, self.right) * self.scale))

    def holds(self, owner: Any) -> bool:
        return self.compare(owner)

    def explain(self, owner: Any) -> str:
        verb = _COMPARISONS[self.op][1]
        on = f" on {self.where}" if self.where else ""
        return (f"{variable(self.left)} ({getattr(owner, self.left)}) {verb} {variable(self.right)} "
                f"({getattr(owner, self.right)}{self.right_unit}){on}: {self.why}")

    def doc(self) -> str:
        """The relation as docs/settings.md states it."""
        scaled = f" x {self.scale}" if self.scale != 1 else ""
        text = f"`{variable(self.left)}` {self.op} `{variable(self.right)}`{scaled}"
        return f"{self.where}: {text}" if self.where else text


REDIS_SCHEMES = ("redis", "rediss", "redis+socket", "sentinel")


def broker_kind(url: object) -> str | None:
    """``"redis"``, ``"rabbitmq"``, another transport's scheme, or None for an empty URL (the Celery
    app's broker decides). Failover URLs (``a;b``) share one transport: the first one names it."""
    if not isinstance(url, str):
        return None
    first = url.split(";", 1)[0].strip()
    if not first:
        return None
    scheme = first.partition("://")[0].lower()
    if scheme in REDIS_SCHEMES:
        return "redis"
    if scheme in ("amqp", "pyamqp", "amqps"):
        return "rabbitmq"
    return scheme


@dataclass(frozen=True)
class BrokerRelation(Relation):
    """A relation that only means something on some brokers: Redis's visibility timeout has no meaning
    on RabbitMQ (a dead consumer's messages come back when its connection closes). With ``broker_url``
    empty the Celery app's broker decides, known only when ``Outbox`` is built: it asks
    ``Settings.broker_relation_problems`` with the app's URL."""

    brokers: tuple[str, ...] = ("redis",)

    @property
    def where(self) -> str:
        return " or ".join(BROKER_NAMES.get(b, b) for b in self.brokers)

    def holds(self, owner: Any) -> bool:
        return not self.applies(owner, owner.broker_url) or self.compare(owner)

    def applies(self, owner: Owner, broker_url: str) -> bool:
        return owner.kind_of_broker(broker_url) in self.brokers
