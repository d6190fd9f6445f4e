"""The rules of the settings: how one ``OUTBOX_<FIELD>`` variable is read and which values it may take.

A rule knows nothing of ``Settings``: it only names what it asks of the settings it checks (``Owner``).
Its complaints are phrases (``must be ...``); the caller names the variable (``clause``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from celery_outbox.config.masking import MASK, bounded_repr, mask_secrets, mask_url
from celery_outbox.errors import ConfigError
from celery_outbox.names import check_name
from celery_outbox.schema import check_prefix

SECOND_MS = 1000
MINUTE_MS = 60 * SECOND_MS
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS
MAX_EVENT_TYPE_LENGTH = 200  # the ``type`` columns are String(200)


class Invalid(Exception):
    """A rule's complaint, without the variable name (the caller adds it)."""


# -- rules ---------------------------------------------------------------------------------------

class Owner(Protocol):
    """What a rule asks of the settings whose value it checks."""

    @property
    def broker_url(self) -> str: ...

    def allows_broker_alias(self, url: str) -> bool: ...

    def kind_of_broker(self, url: object) -> str | None: ...


class Rule:
    """How one field is read from ``OUTBOX_<FIELD>`` and which values it may take."""

    secret = False  # a value never shown whole (repr, errors)

    def parse(self, raw: str) -> Any:
        return raw

    def as_env(self, value: Any) -> str:
        """``value`` as its ``OUTBOX_<FIELD>`` variable holds it (what ``parse`` reads back)."""
        return str(value)

    def allowed(self) -> str:
        """The values it takes, as docs/settings.md says it."""
        return ""

    def normalize(self, value: Any) -> Any:
        """The canonical form of a value given in code (before ``problem`` sees it)."""
        return value

    def problem(self, value: Any, owner: Owner) -> str | None:
        """What is wrong with ``value`` (a phrase like ``must be ...``), or None."""
        raise NotImplementedError

    def masked(self, value: Any) -> Any:
        return value

    def shown(self, value: Any) -> str:
        """``value`` as an error message shows it: one line, bounded, secrets masked."""
        return bounded_repr(self.masked(value))


_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*", re.ASCII)
_FLOAT_TEXT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)


@dataclass(frozen=True)
class IntRule(Rule):
    """An integer in ``[low, high]``; ``zero`` says what 0 means when ``low`` is 0."""

    low: int
    high: int
    zero: str = ""

    def range_text(self) -> str:
        if self.low == 0:
            return f">= 0 ({self.zero}) and <= {self.high}"
        if self.low == 1:
            return f"> 0 and <= {self.high}"
        return f">= {self.low} and <= {self.high}"

    def allowed(self) -> str:
        zero = f" ({self.zero})" if self.low == 0 and self.zero else ""
        return f"{self.low}{zero} to {self.high}"

    def parse(self, raw: str) -> int:
        text = raw.strip()
        if len(text) > 40 or not _INT_TEXT.fullmatch(text):
            raise Invalid(f"must be int ({self.range_text()}, ASCII digits)")
        return int(text)

    def problem(self, value: Any, owner: Owner) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be int ({self.range_text()})"
        if not self.low <= value <= self.high:
            return f"must be {self.range_text()}"
        return None


@dataclass(frozen=True)
class FloatRule(Rule):
    """A finite number of seconds in ``[low, high]`` (``low`` > 0)."""

    low: float
    high: float

    def range_text(self) -> str:
        return f"> 0 (at least {self.low}) and <= {self.high:g}"

    def allowed(self) -> str:
        return f"{self.low:g} to {self.high:g}"

    def parse(self, raw: str) -> float:
        text = raw.strip()
        if len(text) > 40 or not _FLOAT_TEXT.fullmatch(text):
            raise Invalid(f"must be a finite number {self.range_text()}")
        return float(text)

    def normalize(self, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and self.low <= value <= self.high:
            return float(value)
        return value

    def problem(self, value: Any, owner: Owner) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number {self.range_text()}"
        if (isinstance(value, float) and not math.isfinite(value)) or not self.low <= value <= self.high:
            return f"must be a finite number {self.range_text()}"
        return None


def _text_problem(value: Any, max_length: int) -> str | None:
    if not isinstance(value, str):
        return "must be text"
    if len(value) > max_length:
        return f"must be at most {max_length} characters"
    if not value.isprintable():
        return "must be printable text (no control characters, NUL or lone surrogates)"
    return None


@dataclass(frozen=True)
class ChoiceRule(Rule):
    options: tuple[str, ...]

    def allowed(self) -> str:
        return ", ".join(f"`{o}`" for o in self.options)

    def problem(self, value: Any, owner: Owner) -> str | None:
        return None if value in self.options else f"must be {', '.join(self.options[:-1])} or {self.options[-1]}"


@dataclass(frozen=True)
class PatternRule(Rule):
    """Text matching ``regex`` (ASCII), explained by ``text``."""

    regex: str
    text: str

    def allowed(self) -> str:
        return self.text

    def problem(self, value: Any, owner: Owner) -> str | None:
        if not isinstance(value, str) or not re.fullmatch(self.regex, value, re.ASCII):
            return f"must be {self.text}"
        return None


class PrefixRule(Rule):
    def allowed(self) -> str:
        return "lower-case letters, digits and `_`, ending in `_`"

    def problem(self, value: Any, owner: Owner) -> str | None:
        try:
            check_prefix(value)
        except ConfigError:  # its text repeats the value whole; the clause shows it bounded
            return ("must be a table prefix: lower-case letters, digits and '_', starting with a letter, at most 30 "
                    "characters (e.g. 'outbox_')")
        return None


MIN_TOKEN_LENGTH = 16  # a guessable admin token guards nothing


class TokenRule(Rule):
    """A secret: empty (off) or printable text of at least ``MIN_TOKEN_LENGTH`` characters, never shown."""

    secret = True

    def allowed(self) -> str:
        return f"empty (off) or at least {MIN_TOKEN_LENGTH} characters"

    def problem(self, value: Any, owner: Owner) -> str | None:
        trouble = _text_problem(value, 4096)
        if trouble is None and value != value.strip():
            trouble = "must not start or end with whitespace"
        if trouble is None and value and len(value) < MIN_TOKEN_LENGTH:
            trouble = f"must be at least {MIN_TOKEN_LENGTH} characters (or empty: off)"
        return trouble

    def masked(self, value: Any) -> Any:
        return MASK if value else value

    def shown(self, value: Any) -> str:
        return "a secret value (not shown)"


@dataclass(frozen=True)
class UrlRule(Rule):
    """Empty (the documented default) or a URL of one of ``schemes``; its password is never shown."""

    schemes: tuple[str, ...]
    text: str
    broker: bool = False  # a kombu URL: ';'-separated failover URLs, aliases the owner allows
    secret = True

    def allowed(self) -> str:
        text = self.text if self.text.startswith("empty") else f"empty or {self.text}"
        return text + ("; several separated by `;` (failover)" if self.broker else "")

    def problem(self, value: Any, owner: Owner) -> str | None:
        trouble = _text_problem(value, 4096)
        if trouble is not None or not value:
            return trouble
        if self.broker and owner.allows_broker_alias(value):
            return None
        for url in value.split(";") if self.broker else [value]:
            trouble = self._one(url)
            if trouble is not None:
                return trouble
        return None

    def _one(self, url: str) -> str | None:
        scheme = url.partition("://")[0].lower()
        if "://" not in url or scheme.split("+", 1)[0] not in self.schemes:
            return f"must be {self.text}"
        if any(c.isspace() for c in url):
            return f"must be {self.text}, without whitespace"
        if self.broker:
            from urllib.parse import urlsplit

            try:
                port = urlsplit(url).port  # raises for a port out of range or not a number
            except ValueError:
                port = 0
            return f"must be {self.text} with a port in 1-65535" if port == 0 else None
        from sqlalchemy.engine import make_url

        try:
            parsed = make_url(url)
        except Exception:  # any parse failure is a bad URL (and its text may hold a password)
            return f"must be {self.text} (this one cannot be parsed)"
        if parsed.port is not None and not 1 <= parsed.port <= 65535:
            return f"must be {self.text} with a port in 1-65535"
        return None

    def masked(self, value: Any) -> Any:
        return mask_url(value) if isinstance(value, str) else value

    def shown(self, value: Any) -> str:
        if isinstance(value, str) and value and "://" not in value:
            return "a value that is not a URL (not shown: it may be a password)"
        return bounded_repr(self.masked(value))


class RoutesRule(Rule):
    """Event type -> consumer names: ``"A=x,y;B=z"``. Names are checked exactly like ``@consumer`` names.

    An event type given twice or a consumer named twice in one route is refused, not merged or
    overwritten: the writer would accept that configuration and then refuse every event of the type.
    """

    def allowed(self) -> str:
        return "`EventType=consumer[,consumer...]` separated by `;`"

    def as_env(self, value: Any) -> str:
        return ";".join(f"{t}={','.join(c)}" for t, c in value.items())

    def parse(self, raw: str) -> dict[str, tuple[str, ...]]:
        routes: dict[str, tuple[str, ...]] = {}
        if not raw.strip():  # set and empty: no routes from the settings (what ``to_env`` writes for none)
            return routes
        for part in filter(None, (p.strip() for p in raw.split(";"))):
            event, sep, consumers = part.partition("=")
            names = tuple(filter(None, (c.strip() for c in consumers.split(","))))
            if not sep or not event.strip() or not names:
                raise Invalid(f"must be 'EventType=consumer[,consumer...]' separated by ';' ({bounded_repr(part)} is not)")
            if event.strip() in routes:
                raise Invalid(f"routes {bounded_repr(event.strip())} twice; give each event type once, with all its "
                               "consumers")
            routes[event.strip()] = names
        if not routes:
            raise Invalid("is set but names no route; unset it to use the defaults")
        return routes

    def normalize(self, value: Any) -> Any:
        if isinstance(value, Mapping) and all(isinstance(v, (tuple, list)) for v in value.values()):
            return {k: tuple(v) for k, v in value.items()}
        return value

    def problem(self, value: Any, owner: Owner) -> str | None:

        if not isinstance(value, Mapping):
            return "must map event types to consumer names"
        for event, names in value.items():
            trouble = _text_problem(event, MAX_EVENT_TYPE_LENGTH)
            if trouble is None and (not event.strip() or event != event.strip() or any(c in event for c in ";=,")):
                trouble = "must be non-empty, without surrounding spaces or ';', '=' or ','"
            if trouble is not None:
                return f"event type {bounded_repr(event)} {trouble}"
            if isinstance(names, str) or not isinstance(names, (tuple, list)) or not names:
                return f"must route {bounded_repr(event)} to a non-empty tuple of consumer names"
            twice = [n for i, n in enumerate(names) if n in names[:i]]
            if twice:
                return f"routes {bounded_repr(event)} to {bounded_repr(twice[0])} twice; name each consumer once"
            for name in names:
                try:
                    check_name(name)
                except ConfigError as e:
                    return f"routes {bounded_repr(event)} to a bad consumer: {e}"
        return None


class TaskNamesRule(Rule):
    """Celery task names: a tuple in code, ``"a.x,b.y"`` in the environment (empty: none)."""

    def allowed(self) -> str:
        return "task names separated by `,`"

    def as_env(self, value: Any) -> str:
        return ",".join(value)

    def parse(self, raw: str) -> tuple[str, ...]:
        return tuple(filter(None, (n.strip() for n in raw.split(","))))

    def normalize(self, value: Any) -> Any:
        return tuple(value) if isinstance(value, (list, frozenset, set)) else value

    def problem(self, value: Any, owner: Owner) -> str | None:
        if not isinstance(value, tuple):
            return "must be a tuple of task names"
        for name in value:
            trouble = _text_problem(name, MAX_EVENT_TYPE_LENGTH)
            if trouble is None and (not name.strip() or name != name.strip() or "," in name):
                trouble = "must be non-empty, without surrounding spaces or ','"
            if trouble is not None:
                return f"task name {bounded_repr(name)} {trouble}"
        return None


class CrashPointsRule(Rule):
    def allowed(self) -> str:
        return "`name[@N],...` (N: 1 to 999999999)"

    def problem(self, value: Any, owner: Owner) -> str | None:
        from celery_outbox.crashpoints import CrashPoints

        trouble = _text_problem(value, 1000)
        if trouble is not None:
            return trouble
        try:
            CrashPoints(spec=value)
        except ConfigError as e:
            return f"is not valid: {e}"
        return None


class PathRule(Rule):
    """A filesystem path (a deployment's home): non-empty, printable."""

    def allowed(self) -> str:
        return "a non-empty path"

    def as_env(self, value: Any) -> str:
        return str(Path(value).resolve())

    def parse(self, raw: str) -> Path:
        if not raw.strip():
            raise Invalid("must be a non-empty path")
        return Path(raw)

    def normalize(self, value: Any) -> Any:
        return Path(value) if isinstance(value, str) and value.strip() and "\x00" not in value else value

    def problem(self, value: Any, owner: Owner) -> str | None:
        if not isinstance(value, (str, Path)):
            return "must be a path"
        text = str(value)
        if not text.strip():
            return "must be a non-empty path"
        return _text_problem(text, 4096)


def clause(key: str, trouble: str, value: Any, rule: Rule) -> str:
    """One clause of a ``ConfigError``: the variable, what is wrong, the value as the rule may show it. A URL
    password is never in it, whichever setting the URL was given to (a misplaced one is no less a secret)."""
    return mask_secrets(f"{key} {trouble}, got {rule.shown(value)}", source=value if isinstance(value, str) else "")
