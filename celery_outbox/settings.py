"""Settings: one validated object passed in, with one precedence rule wherever it is built.

**Explicit arguments > ``OUTBOX_*`` environment variables > defaults.** ``Settings(namespace="shop")``
takes ``namespace`` from the code and every other field from its ``OUTBOX_<FIELD>`` variable when the
operator set one (``OUTBOX_ADMIN_TOKEN``, ``OUTBOX_ENQUEUE_OUTSIDE_TRANSACTION``...), else its default.
``Settings.from_env(environ, **overrides)`` is the same rule over a given mapping (``from_env({}, ...)``:
no environment at all, for tests). ``replace()`` keeps every value it copies. The environment is read
when a ``Settings`` is built, never on import.

Every field has exactly one rule in ``Settings.RULES`` (a deployment's subclass extends the table):
how its variable is read, which values it may take (numbers finite and in range for where they go,
text printable and of the right form) and whether it is a secret (masked in ``repr``/``str`` and in
every error). Rules between fields are in ``Settings.RELATIONS``. A field without a rule is a
programming error caught the first time the class is built.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NoReturn, Self

from celery_outbox.errors import ConfigError
from celery_outbox.names import check_name
from celery_outbox.schema import DEFAULT_PREFIX, check_prefix

SECOND_MS = 1000
MINUTE_MS = 60 * SECOND_MS
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS
MAX_EVENT_TYPE_LENGTH = 200  # the ``type`` columns are String(200)
MASK = "***"


# -- secrets -------------------------------------------------------------------------------------

_SECRET_QUERY = re.compile(r"(?i)([?&;](?:password|passwd|pwd|pass|secret|token|api_key|apikey|sslpassword|"
                           r"sslkey|access_key|secret_key)=)[^&;#]*")


def mask_url(url: str) -> str:
    """``url`` with its password (and any password-like query parameter) replaced by ``***``.

    Conservative: everything between the user name and the last ``@`` before the path is hidden, so
    a password with an unescaped ``@`` or ``/`` is hidden too; several URLs separated by ``;``
    (kombu failover) are masked one by one.
    """
    if ";" in url and "://" in url.split(";", 1)[1]:
        return ";".join(mask_url(part) for part in url.split(";"))
    scheme, sep, rest = url.partition("://")
    if not sep:  # not a URL: hide whatever could be user info
        at = url.rfind("@")
        return _SECRET_QUERY.sub(rf"\1{MASK}", url if at < 0 else MASK + url[at:])
    at = rest.rfind("@")
    if at >= 0:
        userinfo, host = rest[:at], rest[at + 1:]
        user, colon, _password = userinfo.partition(":")
        if "/" in user:  # an unescaped '/' in the user info: hide all of it
            user, colon = MASK, ""
        rest = f"{user}:{MASK}@{host}" if colon else f"{user}@{host}"
    return _SECRET_QUERY.sub(rf"\1{MASK}", f"{scheme}://{rest}")


def _show(value: Any, limit: int = 80) -> str:
    """One line, bounded: a value as an error message shows it."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...(truncated)"


class _Invalid(Exception):
    """A rule's complaint, without the variable name (the caller adds it)."""


# -- rules ---------------------------------------------------------------------------------------

class Rule:
    """How one field is read from ``OUTBOX_<FIELD>`` and which values it may take."""

    secret = False  # a value never shown whole (repr, errors)

    def parse(self, raw: str) -> Any:
        return raw

    def normalize(self, value: Any) -> Any:
        """The canonical form of a value given in code (before ``problem`` sees it)."""
        return value

    def problem(self, value: Any, owner: Settings) -> str | None:
        """What is wrong with ``value`` (a phrase like ``must be ...``), or None."""
        raise NotImplementedError

    def masked(self, value: Any) -> Any:
        return value

    def shown(self, value: Any) -> str:
        """``value`` as an error message shows it: one line, bounded, secrets masked."""
        return _show(self.masked(value))


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

    def parse(self, raw: str) -> int:
        text = raw.strip()
        if len(text) > 40 or not _INT_TEXT.fullmatch(text):
            raise _Invalid(f"must be int ({self.range_text()}, ASCII digits)")
        return int(text)

    def problem(self, value: Any, owner: Settings) -> str | None:
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

    def parse(self, raw: str) -> float:
        text = raw.strip()
        if len(text) > 40 or not _FLOAT_TEXT.fullmatch(text):
            raise _Invalid(f"must be a finite number {self.range_text()}")
        return float(text)

    def normalize(self, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and self.low <= value <= self.high:
            return float(value)
        return value

    def problem(self, value: Any, owner: Settings) -> str | None:
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

    def problem(self, value: Any, owner: Settings) -> str | None:
        return None if value in self.options else f"must be {', '.join(self.options[:-1])} or {self.options[-1]}"


@dataclass(frozen=True)
class PatternRule(Rule):
    """Text matching ``regex`` (ASCII), explained by ``text``."""

    regex: str
    text: str

    def problem(self, value: Any, owner: Settings) -> str | None:
        if not isinstance(value, str) or not re.fullmatch(self.regex, value, re.ASCII):
            return f"must be {self.text}"
        return None


class PrefixRule(Rule):
    def problem(self, value: Any, owner: Settings) -> str | None:
        try:
            check_prefix(value)
        except ConfigError as e:
            return f"is not a valid table prefix: {e}"
        return None


MIN_TOKEN_LENGTH = 16  # a guessable admin token guards nothing


class TokenRule(Rule):
    """A secret: empty (off) or printable text of at least ``MIN_TOKEN_LENGTH`` characters, never shown."""

    secret = True

    def problem(self, value: Any, owner: Settings) -> str | None:
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

    def problem(self, value: Any, owner: Settings) -> str | None:
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
        return _show(self.masked(value))


class RoutesRule(Rule):
    """Event type -> consumer names: ``"A=x,y;B=z"``. Names are checked exactly like ``@consumer`` names.

    An event type given twice or a consumer named twice in one route is refused, not merged or
    overwritten: the writer would accept that configuration and then refuse every event of the type.
    """

    def parse(self, raw: str) -> dict[str, tuple[str, ...]]:
        routes: dict[str, tuple[str, ...]] = {}
        if not raw.strip():  # set and empty: no routes from the settings (what ``to_env`` writes for none)
            return routes
        for part in filter(None, (p.strip() for p in raw.split(";"))):
            event, sep, consumers = part.partition("=")
            names = tuple(filter(None, (c.strip() for c in consumers.split(","))))
            if not sep or not event.strip() or not names:
                raise _Invalid(f"must be 'EventType=consumer[,consumer...]' separated by ';' ({_show(part)} is not)")
            if event.strip() in routes:
                raise _Invalid(f"routes {_show(event.strip())} twice; give each event type once, with all its "
                               "consumers")
            routes[event.strip()] = names
        if not routes:
            raise _Invalid("is set but names no route; unset it to use the defaults")
        return routes

    def normalize(self, value: Any) -> Any:
        if isinstance(value, Mapping) and all(isinstance(v, (tuple, list)) for v in value.values()):
            return {k: tuple(v) for k, v in value.items()}
        return value

    def problem(self, value: Any, owner: Settings) -> str | None:

        if not isinstance(value, Mapping):
            return "must map event types to consumer names"
        for event, names in value.items():
            trouble = _text_problem(event, MAX_EVENT_TYPE_LENGTH)
            if trouble is None and (not event.strip() or event != event.strip() or any(c in event for c in ";=,")):
                trouble = "must be non-empty, without surrounding spaces or ';', '=' or ','"
            if trouble is not None:
                return f"event type {_show(event)} {trouble}"
            if isinstance(names, str) or not isinstance(names, (tuple, list)) or not names:
                return f"must route {_show(event)} to a non-empty tuple of consumer names"
            twice = [n for i, n in enumerate(names) if n in names[:i]]
            if twice:
                return f"routes {_show(event)} to {_show(twice[0])} twice; name each consumer once"
            for name in names:
                try:
                    check_name(name)
                except ConfigError as e:
                    return f"routes {_show(event)} to a bad consumer: {e}"
        return None


class TaskNamesRule(Rule):
    """Celery task names: a tuple in code, ``"a.x,b.y"`` in the environment (empty: none)."""

    def parse(self, raw: str) -> tuple[str, ...]:
        return tuple(filter(None, (n.strip() for n in raw.split(","))))

    def normalize(self, value: Any) -> Any:
        return tuple(value) if isinstance(value, (list, frozenset, set)) else value

    def problem(self, value: Any, owner: Settings) -> str | None:
        if not isinstance(value, tuple):
            return "must be a tuple of task names"
        for name in value:
            trouble = _text_problem(name, MAX_EVENT_TYPE_LENGTH)
            if trouble is None and (not name.strip() or name != name.strip() or "," in name):
                trouble = "must be non-empty, without surrounding spaces or ','"
            if trouble is not None:
                return f"task name {_show(name)} {trouble}"
        return None


class CrashPointsRule(Rule):
    def problem(self, value: Any, owner: Settings) -> str | None:
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

    def parse(self, raw: str) -> Path:
        if not raw.strip():
            raise _Invalid("must be a non-empty path")
        return Path(raw)

    def normalize(self, value: Any) -> Any:
        return Path(value) if isinstance(value, str) and value.strip() and "\x00" not in value else value

    def problem(self, value: Any, owner: Settings) -> str | None:
        if not isinstance(value, (str, Path)):
            return "must be a path"
        text = str(value)
        if not text.strip():
            return "must be a non-empty path"
        return _text_problem(text, 4096)


@dataclass(frozen=True)
class Relation:
    """A rule between fields, checked once each of them passed its own rule."""

    fields: tuple[str, ...]
    holds: Callable[[Any], bool]
    explain: Callable[[Any], str]


LIBRARY_RULES: Mapping[str, Rule] = {
    "database_url": UrlRule(("sqlite", "postgresql"), "sqlite:// or postgresql://"),
    "broker_url": UrlRule(("redis", "rediss", "redis+socket", "amqp", "pyamqp", "amqps", "memory"),
                      "redis://... or amqp://...", broker=True),
    "namespace": PatternRule(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}",
                         "non-empty, without ' /#*': 1-64 letters, digits, '_', '-' or '.', starting with a "
                         "letter or digit"),
    "table_prefix": PrefixRule(),
    "routes": RoutesRule(),
    "relay_batch_size": IntRule(1, 10_000),  # the first (and smallest) batch: rows per claim / publish / mark
    # The largest batch the adaptive relay grows to = the most rows published but not yet marked at any
    # moment, so the most duplicates a relay crash can cause (relay/adaptive.py).
    "relay_max_in_flight_rows": IntRule(1, 10_000),
    "relay_poll_interval_s": FloatRule(0.01, 86_400.0),
    # After a NOTIFY wakes the standalone relay, how long it gathers further commits before claiming, while
    # at least GATHER_MIN_COMMITS are expected within the window (relay/loop.py): one claim / publish / mark
    # for several commits.
    "relay_gather_ms": IntRule(0, 1_000, zero="0 = off: claim at once"),
    # The standalone relay's LISTEN connection, when it must bypass a transaction pooler (relay/loop.py).
    "relay_listen_url": UrlRule(("postgresql",), "empty (the database URL) or postgresql://"),
    "relay_max_attempts": IntRule(1, 1_000),  # the attempts column is a 32-bit integer
    "relay_base_delay_ms": IntRule(1, DAY_MS),
    "relay_max_delay_ms": IntRule(1, DAY_MS),
    "relay_breaker_base_ms": IntRule(1, HOUR_MS),
    "relay_breaker_max_ms": IntRule(1, HOUR_MS),
    "relay_publish_timeout_s": FloatRule(0.01, 3_600.0),
    "relay_confirm_mode": ChoiceRule(("confirm", "tx", "none")),
    "max_message_bytes": IntRule(1, 128 * 1024 * 1024),  # RabbitMQ's own maximum message size
    "relay_reconcile_after_ms": IntRule(1, 30 * DAY_MS),
    "relay_reconcile_interval_s": FloatRule(1.0, 86_400.0),
    "relay_reconcile_plain_tasks_after_ms": IntRule(0, 30 * DAY_MS, zero="0 = off: plain tasks are never sent again"),
    "consumer_max_deliveries": IntRule(1, 1_000),  # Celery max_retries; delivery counts are 32-bit columns
    "consumer_retry_backoff_s": IntRule(1, 86_400),
    "consumer_retry_backoff_max_s": IntRule(1, 86_400),
    "consumer_park_timeout_ms": IntRule(1, 30 * DAY_MS),
    "broker_redelivery_window_ms": IntRule(1, 365 * DAY_MS),  # > 0: the inbox-prune guard cannot be turned off
    "broker_visibility_timeout_s": IntRule(1, 7 * 86_400),
    "max_json_depth": IntRule(1, 500),  # below Python's recursion limit (1000), which the JSON decoder uses
    "db_connect_timeout_s": IntRule(1, 600),  # libpq: 0 would mean wait for ever
    "db_statement_timeout_ms": IntRule(1, DAY_MS),  # Postgres: 0 would turn it off; int32 milliseconds
    "db_idle_in_transaction_timeout_ms": IntRule(1, DAY_MS),
    "db_keepalives_idle_s": IntRule(1, 32_767),  # Linux TCP_KEEPIDLE maximum
    "db_keepalives_interval_s": IntRule(1, 32_767),  # Linux TCP_KEEPINTVL maximum
    "db_keepalives_count": IntRule(1, 127),  # Linux TCP_KEEPCNT maximum
    "db_pre_ping_idle_ms": IntRule(0, HOUR_MS, zero="0 = off: a ping on every checkout"),
    "consumer_time_limit_s": IntRule(1, 86_400),
    "metrics_port": IntRule(0, 65_535, zero="0 = off"),
    # Celery tasks sent outside any bound transaction: a row committed on its own (the default), refused,
    # or sent to the broker at once.
    "enqueue_outside_transaction": ChoiceRule(("own_transaction", "raise", "publish")),
    "enqueue_exclude": TaskNamesRule(),  # task names never captured into the outbox
    "enqueue_hold_eta_after_ms": IntRule(1, 365 * DAY_MS),
    "worker_heartbeat_ms": IntRule(0, HOUR_MS, zero="0 = off: workers do not register, the relay holds nothing"),
    "relay_hold_recheck_ms": IntRule(10, HOUR_MS),
    "admin_token": TokenRule(),
    "crash_points": CrashPointsRule(),
    "tracer_provider": PatternRule(r"(?:[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*)?",
                                   "empty or module.path:function (returning an OpenTelemetry TracerProvider)"),
    # RabbitMQ: the type of the consumer, task and relay queues the library declares (celery/config.py).
    "broker_queue_type": ChoiceRule(("classic", "quorum")),
}

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
    """A rule between fields that only means something on some brokers: Redis's visibility timeout
    has no meaning on RabbitMQ (a dead consumer's messages come back when its connection closes).
    With ``broker_url`` empty the Celery app's broker decides, known only when ``Outbox`` is built:
    it calls ``broker_relation_problems`` with the app's URL."""

    brokers: tuple[str, ...] = ("redis",)
    condition: Callable[[Any], bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        condition = self.holds
        object.__setattr__(self, "condition", condition)
        object.__setattr__(self, "holds", lambda s: not self.applies(s, s.broker_url) or condition(s))

    def applies(self, settings: Settings, broker_url: str) -> bool:
        return settings.kind_of_broker(broker_url) in self.brokers


def broker_relation_problems(settings: Settings, broker_url: str) -> list[str]:
    """The broker rules ``settings`` breaks on the broker at ``broker_url`` (the Celery app's, when
    ``settings.broker_url`` is empty; a non-empty one was checked when the settings were built)."""
    if settings.broker_url:
        return []
    return [r.explain(settings) for r in settings.RELATIONS
            if isinstance(r, BrokerRelation) and r.applies(settings, broker_url) and not r.condition(settings)]


LIBRARY_RELATIONS: tuple[Relation, ...] = (
    BrokerRelation(
        ("consumer_retry_backoff_max_s", "broker_visibility_timeout_s"),
        lambda s: s.consumer_retry_backoff_max_s < s.broker_visibility_timeout_s,
        lambda s: f"OUTBOX_CONSUMER_RETRY_BACKOFF_MAX_S ({s.consumer_retry_backoff_max_s}) must be below "
                  f"OUTBOX_BROKER_VISIBILITY_TIMEOUT_S ({s.broker_visibility_timeout_s}) on Redis: a retry "
                  "waiting longer than the visibility timeout is delivered twice",
    ),
    BrokerRelation(
        ("consumer_time_limit_s", "broker_visibility_timeout_s"),
        lambda s: s.consumer_time_limit_s < s.broker_visibility_timeout_s,
        lambda s: f"OUTBOX_CONSUMER_TIME_LIMIT_S ({s.consumer_time_limit_s}) must be below "
                  f"OUTBOX_BROKER_VISIBILITY_TIMEOUT_S ({s.broker_visibility_timeout_s}) on Redis: a delivery "
                  "still running after the visibility timeout is delivered again",
    ),
    BrokerRelation(
        ("relay_reconcile_after_ms", "broker_visibility_timeout_s"),
        lambda s: s.relay_reconcile_after_ms > s.broker_visibility_timeout_s * SECOND_MS,
        lambda s: f"OUTBOX_RELAY_RECONCILE_AFTER_MS ({s.relay_reconcile_after_ms}) must exceed "
                  f"OUTBOX_BROKER_VISIBILITY_TIMEOUT_S ({s.broker_visibility_timeout_s} s) on Redis: the broker's "
                  "own redelivery comes first, the reconciler only catches what is really lost",
    ),
    Relation(
        ("broker_redelivery_window_ms", "relay_reconcile_after_ms"),
        lambda s: s.broker_redelivery_window_ms > s.relay_reconcile_after_ms,
        lambda s: f"OUTBOX_BROKER_REDELIVERY_WINDOW_MS ({s.broker_redelivery_window_ms}) must exceed "
                  f"OUTBOX_RELAY_RECONCILE_AFTER_MS ({s.relay_reconcile_after_ms}): the inbox must outlive every "
                  "redelivery and re-send, or one takes effect twice",
    ),
    Relation(
        ("broker_redelivery_window_ms", "relay_reconcile_plain_tasks_after_ms"),
        lambda s: s.broker_redelivery_window_ms > s.relay_reconcile_plain_tasks_after_ms,
        lambda s: f"OUTBOX_BROKER_REDELIVERY_WINDOW_MS ({s.broker_redelivery_window_ms}) must exceed "
                  f"OUTBOX_RELAY_RECONCILE_PLAIN_TASKS_AFTER_MS ({s.relay_reconcile_plain_tasks_after_ms}): task "
                  "receipts are pruned with the inbox and must outlive the plain-task window, or a task that ran "
                  "is sent again",
    ),
    Relation(
        ("relay_base_delay_ms", "relay_max_delay_ms"),
        lambda s: s.relay_base_delay_ms <= s.relay_max_delay_ms,
        lambda s: f"OUTBOX_RELAY_BASE_DELAY_MS ({s.relay_base_delay_ms}) must not exceed "
                  f"OUTBOX_RELAY_MAX_DELAY_MS ({s.relay_max_delay_ms})",
    ),
    Relation(
        ("relay_batch_size", "relay_max_in_flight_rows"),
        lambda s: s.relay_batch_size <= s.relay_max_in_flight_rows,
        lambda s: f"OUTBOX_RELAY_BATCH_SIZE ({s.relay_batch_size}) must not exceed "
                  f"OUTBOX_RELAY_MAX_IN_FLIGHT_ROWS ({s.relay_max_in_flight_rows}): a batch is published whole "
                  "before it is marked",
    ),
    Relation(
        ("relay_breaker_base_ms", "relay_breaker_max_ms"),
        lambda s: s.relay_breaker_base_ms <= s.relay_breaker_max_ms,
        lambda s: f"OUTBOX_RELAY_BREAKER_BASE_MS ({s.relay_breaker_base_ms}) must not exceed "
                  f"OUTBOX_RELAY_BREAKER_MAX_MS ({s.relay_breaker_max_ms})",
    ),
)


# -- settings ------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Settings:
    """Every knob of the library. Pass one to ``Outbox``: explicit arguments > ``OUTBOX_*`` > defaults."""

    RULES: ClassVar[Mapping[str, Rule]] = LIBRARY_RULES
    RELATIONS: ClassVar[tuple[Relation, ...]] = LIBRARY_RELATIONS

    database_url: str = ""  # empty: the engine or session factory given to ``Outbox``
    broker_url: str = ""  # empty: the Celery app's own broker_url
    namespace: str = "outbox"  # prefix of exchange and queue names
    table_prefix: str = DEFAULT_PREFIX  # prefix of the library's table names
    # Extra routes (event type -> consumers), merged over those the consumers declare in code.
    routes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    # The relay's batch starts at relay_batch_size, doubles while batches come back full, up to
    # relay_max_in_flight_rows (the bound on duplicates after a crash), and halves when idle.
    relay_batch_size: int = 100
    relay_max_in_flight_rows: int = 1_000
    relay_poll_interval_s: float = 1.0
    # Gathers only while commits come faster than one per window, so a trickle pays no latency (docs/settings.md).
    relay_gather_ms: int = 20
    relay_listen_url: str = ""  # empty: LISTEN through the database URL (docs/deployment.md, "Behind PgBouncer")
    relay_max_attempts: int = 10
    relay_base_delay_ms: int = 1_000
    relay_max_delay_ms: int = 300_000
    relay_breaker_base_ms: int = 1_000
    relay_breaker_max_ms: int = 60_000
    relay_publish_timeout_s: float = 10.0
    relay_confirm_mode: str = "confirm"  # confirm | tx | none (RabbitMQ durability per batch)
    max_message_bytes: int = 256 * 1024
    # Reconciler (relay/reconcile.py): a published event some consumer has not recorded, or an
    # @outbox.task with no inbox row, this long after its publish is sent again. On Redis it must exceed
    # the visibility timeout (plus kombu's restore scans: 30 s + 2 x 3 s), so the broker's own
    # redelivery comes first. A take-window loss is back within after + interval (+ a poll).
    relay_reconcile_after_ms: int = 40_000
    relay_reconcile_interval_s: float = 5.0
    # Plain tasks (no inbox; a worker receipt instead) get a longer window (never shorter than
    # relay_reconcile_after_ms): re-sending one that is merely queued runs it twice. 0 = never re-sent.
    relay_reconcile_plain_tasks_after_ms: int = 600_000

    consumer_max_deliveries: int = 3
    consumer_retry_backoff_s: int = 1
    consumer_retry_backoff_max_s: int = 10  # below broker_visibility_timeout_s (Redis holds a waiting retry unacked)
    consumer_park_timeout_ms: int = 600_000
    broker_redelivery_window_ms: int = 24 * 3600 * 1000
    # Redis only: a message a worker took and never acked (worker killed whole) is redelivered after
    # this long. It must exceed the longest retry countdown (Redis holds ETA retries unacked too),
    # else a waiting retry is delivered twice (absorbed by the inbox, but wasted work). Short, so a
    # killed worker's messages come back in seconds (docs/settings.md: a plain task running longer
    # than this on Redis is delivered twice; raise it with the consumer time limit for slow work).
    broker_visibility_timeout_s: int = 30

    # Untrusted JSON (delivered bodies, HTTP input, stored payloads) nested deeper than this is refused.
    max_json_depth: int = 64
    # A database that stops answering without closing the connection must not freeze anyone:
    # connect timeout, TCP keepalives, and (Postgres) statement and idle-in-transaction timeouts.
    db_connect_timeout_s: int = 10
    db_statement_timeout_ms: int = 30_000
    db_idle_in_transaction_timeout_ms: int = 60_000
    db_keepalives_idle_s: int = 30
    db_keepalives_interval_s: int = 10
    db_keepalives_count: int = 3
    # A pooled connection idle longer than this is pinged at checkout (a restarted server is a blip);
    # one used more recently is not: at saturation that ping was a round trip per delivery (db.py).
    db_pre_ping_idle_ms: int = 1_000
    # A consumer delivery that runs longer is killed (and redelivered, counted): no hang for ever.
    consumer_time_limit_s: int = 20  # below broker_visibility_timeout_s (Redis redelivers a longer one)

    # Transactional enqueue (celery_outbox/celery/enqueue.py): ``task.delay()`` outside a transaction
    # bound with ``outbox.transaction(session)`` (or Django's ``atomic()``) writes its row in a short
    # transaction of its own ("own_transaction": durable, not atomic with earlier writes), raises
    # ("raise", the strict mode), or goes to the broker directly as plain Celery would ("publish");
    # excluded task names are never captured.
    enqueue_outside_transaction: str = "own_transaction"
    enqueue_exclude: tuple[str, ...] = ()
    # A captured task whose eta (countdown) is further ahead than this stays an outbox row until due and is
    # published then without an eta, so no worker holds it unacked (docs/scheduled.md).
    enqueue_hold_eta_after_ms: int = 1_000
    # Deploy-safe publishing (celery_outbox/workers.py, docs/scheduled.md "Deploys"): every worker registers
    # its queues and task names and refreshes them this often (expired after 3 missed heartbeats); the relay
    # holds a task row that a live registered worker of its queue cannot run, and looks again after
    # relay_hold_recheck_ms, charging no attempt. 0 = off (no registry, nothing held).
    worker_heartbeat_ms: int = 10_000
    relay_hold_recheck_ms: int = 2_000

    metrics_port: int = 0  # worker /metrics port; 0 = off (the Flask app always serves /metrics)
    admin_token: str = ""  # a secret: masked in repr/str and errors
    crash_points: str = ""  # comma separated names armed for chaos tests
    # "module:function" returning an OpenTelemetry TracerProvider, installed in every process that runs
    # outbox work: where the Outbox is built and in each worker pool process (celery/tracing_hook.py).
    tracer_provider: str = ""
    # RabbitMQ only: "quorum" declares the library's queues replicated over a cluster, with a broker-side
    # delivery limit above the consumers' own (celery/config.py ``queue_arguments``, docs/scaling.md).
    broker_queue_type: str = "classic"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # ``@dataclass`` on a subclass would generate a repr showing every value, passwords included;
        # it keeps a ``__repr__`` the class itself defines, so every subclass gets the masking one.
        super().__init_subclass__(**kwargs)
        for name in ("__repr__", "__str__"):
            if name not in cls.__dict__:
                setattr(cls, name, Settings.__dict__[name])

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={self._shown(f.name)}" for f in dataclasses.fields(self) if f.repr)
        return f"{type(self).__qualname__}({shown})"

    __str__ = __repr__

    def _shown(self, name: str) -> str:
        value = getattr(self, name)
        rule = self.RULES.get(name)
        return repr(rule.masked(value) if rule is not None else value)

    @property
    def effective_database_url(self) -> str:
        if not self.database_url:
            raise ConfigError("no database: set OUTBOX_DATABASE_URL or pass engine=/session_factory= to Outbox")
        return self.database_url

    @property
    def exchange_name(self) -> str:
        return f"{self.namespace}.events"

    def queue_name(self, consumer: str) -> str:
        return f"{self.namespace}.{consumer}"

    @property
    def consumers(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for names in self.routes.values():
            for name in names:
                seen[name] = None
        return tuple(seen)

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # Which fields the caller gave: only the others are read from the environment (``__post_init__``).
        self = super().__new__(cls)
        object.__setattr__(self, "_explicit", frozenset(kwargs))
        return self

    def __post_init__(self) -> None:
        explicit = self.__dict__.pop("_explicit", None)
        names = {f.name for f in dataclasses.fields(self)}
        if explicit is not None and not names <= explicit:
            for name, value in self._read_env(os.environ, skip=explicit).items():
                object.__setattr__(self, name, value)
        rules = self._rules()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            normal = rules[f.name].normalize(value)
            if normal is not value:
                object.__setattr__(self, f.name, normal)  # frozen: the canonical form, once, before validation
        self.validate()

    def allows_broker_alias(self, url: str) -> bool:
        """A deployment may accept a named broker (the demo's "embedded"); the library accepts none."""
        return False

    def kind_of_broker(self, url: object) -> str | None:
        """Which broker ``url`` is (``broker_kind``); a deployment names what its aliases are."""
        return broker_kind(url)

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)

    def to_env(self) -> dict[str, str]:
        """The ``OUTBOX_*`` variables that make a child process build these same settings (secrets included)."""
        env: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "routes":
                value = ";".join(f"{t}={','.join(c)}" for t, c in value.items())
            elif f.name == "enqueue_exclude":
                value = ",".join(value)
            elif isinstance(value, Path):
                value = value.resolve()
            env[f"OUTBOX_{f.name.upper()}"] = str(value)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """``overrides`` > ``OUTBOX_<FIELD>`` variables of ``environ`` (``os.environ`` by default) > defaults.

        Any bad value raises one ``ConfigError`` whose message is one line: a clause per bad variable,
        naming it, separated by ``; `` (a secret's value is never repeated).
        """
        values = cls._read_env(os.environ if environ is None else environ, skip=frozenset(overrides))
        for f in dataclasses.fields(cls):  # every field given: the constructor reads no other environment
            if f.name not in values and f.name not in overrides and f.init:
                if f.default is not dataclasses.MISSING:
                    values[f.name] = f.default
                elif f.default_factory is not dataclasses.MISSING:
                    values[f.name] = f.default_factory()
        values.update(overrides)
        return cls(**values)

    @classmethod
    def _read_env(cls, env: Mapping[str, str], *, skip: frozenset[str]) -> dict[str, Any]:
        """The fields (except ``skip``) whose ``OUTBOX_<FIELD>`` variable ``env`` sets, parsed by their rule."""
        rules = cls._rules()
        values: dict[str, Any] = {}
        errors: list[str] = []
        for f in dataclasses.fields(cls):
            key = f"OUTBOX_{f.name.upper()}"
            if key not in env or f.name in skip:
                continue
            raw = env[key]
            rule = rules[f.name]
            try:
                values[f.name] = rule.parse(raw)
            except _Invalid as e:
                errors.append(_clause(key, str(e), raw, rule))
        if errors:
            raise ConfigError("; ".join(errors))
        return values

    @classmethod
    def _rules(cls) -> Mapping[str, Rule]:
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in cls.RULES]
        if missing:  # a programming error: every field states its rule
            raise TypeError(f"{cls.__qualname__}: no rule in RULES for {', '.join(missing)}")
        return cls.RULES

    def validate(self) -> None:
        """Raise one ``ConfigError`` naming every bad field (one line); see ``RULES`` and ``RELATIONS``."""
        rules = self._rules()
        errors: list[str] = []
        bad: set[str] = set()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            rule = rules[f.name]
            trouble = rule.problem(value, self)
            if trouble is not None:
                bad.add(f.name)
                errors.append(_clause(f"OUTBOX_{f.name.upper()}", trouble, value, rule))
        for relation in self.RELATIONS:
            if not bad.intersection(relation.fields) and not relation.holds(self):
                errors.append(relation.explain(self))
        if errors:
            raise ConfigError("; ".join(errors))


def _clause(key: str, trouble: str, value: Any, rule: Rule) -> str:
    return f"{key} {trouble}, got {rule.shown(value)}"


@contextmanager
def exit_on_config_error(code: int = 2) -> Iterator[None]:
    """At an entry point (a Celery ``-A`` module, a WSGI module): a ``ConfigError`` becomes one line
    ``bad configuration: ...`` on stderr and exit status ``code`` (2, like the ``outbox`` CLI), never
    a traceback. Under gunicorn pass ``code=4``: its master stops on a worker that exits 4 ("App
    failed to load") instead of starting workers again for ever.
    """
    try:
        yield
    except ConfigError as e:
        _exit(e, code)


_URL_PASSWORD = re.compile(r"""([A-Za-z][A-Za-z0-9+.-]*://[^\s:/@'"]*):[^\s@'"]*@""")


def _exit(error: ConfigError, code: int) -> NoReturn:
    # one line whatever the message holds, and no URL password even from an error raised elsewhere
    message = _URL_PASSWORD.sub(rf"\1:{MASK}@", " ".join(str(error).split()))
    sys.stderr.write(f"bad configuration: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code) from None


def broker_is_rabbitmq(url: str) -> bool:
    return url.startswith(("amqp://", "pyamqp://", "amqps://"))
