"""Settings: one validated object passed in; ``OUTBOX_*`` environment variables only as a fallback.

``Settings.from_env()`` is the one place that reads the environment, called at the edge (the CLI, a
deployment's config module), never on import.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from celery_outbox.errors import ConfigError
from celery_outbox.schema import DEFAULT_PREFIX, check_prefix


def _parse_routes(raw: str) -> dict[str, tuple[str, ...]]:
    """``"OrderPlaced=shipping,billing;OrderCancelled=billing"`` -> mapping of event type to consumers."""
    routes: dict[str, tuple[str, ...]] = {}
    for part in filter(None, (p.strip() for p in raw.split(";"))):
        event, sep, consumers = part.partition("=")
        names = tuple(filter(None, (c.strip() for c in consumers.split(","))))
        if not sep or not event.strip() or not names:
            raise ConfigError(
                f"OUTBOX_ROUTES: {part!r} is not 'EventType=consumer[,consumer...]' "
                "(separate events with ';')"
            )
        routes[event.strip()] = names
    if not routes:
        raise ConfigError("OUTBOX_ROUTES is set but names no route; unset it to use the defaults")
    return routes


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Every knob of the library. Pass one to ``Outbox``; ``from_env`` is the fallback at the edge."""

    database_url: str = ""  # empty: the engine or session factory given to ``Outbox``
    broker_url: str = ""  # empty: the Celery app's own broker_url
    namespace: str = "outbox"  # prefix of exchange and queue names
    table_prefix: str = DEFAULT_PREFIX  # prefix of the library's table names
    # Extra routes (event type -> consumers), merged over those the consumers declare in code.
    routes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    relay_batch_size: int = 100
    relay_poll_interval_s: float = 1.0
    relay_max_attempts: int = 10
    relay_base_delay_ms: int = 1_000
    relay_max_delay_ms: int = 300_000
    relay_breaker_base_ms: int = 1_000
    relay_breaker_max_ms: int = 60_000
    relay_publish_timeout_s: float = 10.0
    relay_confirm_mode: str = "confirm"  # confirm | tx | none (RabbitMQ durability per batch)
    max_message_bytes: int = 256 * 1024
    # Reconciler: a published event some consumer has not recorded this long after is sent again
    # (relay/reconcile.py); it must exceed the Redis visibility timeout, which redelivers first.
    relay_reconcile_after_ms: int = 600_000
    relay_reconcile_interval_s: float = 60.0

    consumer_max_deliveries: int = 3
    consumer_retry_backoff_s: int = 1
    consumer_retry_backoff_max_s: int = 60
    consumer_park_timeout_ms: int = 600_000
    broker_redelivery_window_ms: int = 24 * 3600 * 1000
    # Redis only: a message a worker took and never acked (worker killed whole) is redelivered after
    # this long. It must exceed the longest retry countdown (Redis holds ETA retries unacked too),
    # else a waiting retry is delivered twice (absorbed by the inbox, but wasted work).
    broker_visibility_timeout_s: int = 300

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
    # A consumer delivery that runs longer is killed (and redelivered, counted): no hang for ever.
    consumer_time_limit_s: int = 120  # below broker_visibility_timeout_s (Redis redelivers a longer one)

    metrics_port: int = 0  # worker /metrics port; 0 = off (the Flask app always serves /metrics)
    admin_token: str = ""
    crash_points: str = ""  # comma separated names armed for chaos tests

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

    def __post_init__(self) -> None:
        self.validate()

    def allows_broker_alias(self, url: str) -> bool:
        """A deployment may accept a named broker (the demo's "embedded"); the library accepts none."""
        return False

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)

    def to_env(self) -> dict[str, str]:
        """The ``OUTBOX_*`` variables that make a child process build these same settings."""
        env: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "routes":
                value = ";".join(f"{t}={','.join(c)}" for t, c in value.items())
            elif isinstance(value, Path):
                value = value.resolve()
            env[f"OUTBOX_{f.name.upper()}"] = str(value)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """Build settings from ``OUTBOX_<FIELD>`` variables; a malformed value raises ``ConfigError``."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = f"OUTBOX_{f.name.upper()}"
            if key not in env:
                continue
            raw = env[key]
            values[f.name] = _coerce(key, raw, f.type)
        values.update(overrides)
        return cls(**values)

    def validate(self) -> None:
        positive = (
            "relay_batch_size", "relay_max_attempts", "relay_base_delay_ms", "relay_max_delay_ms",
            "relay_breaker_base_ms", "relay_breaker_max_ms", "max_message_bytes", "relay_reconcile_after_ms",
            "relay_reconcile_interval_s",
            "consumer_max_deliveries", "broker_visibility_timeout_s",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"OUTBOX_{name.upper()} must be > 0, got {getattr(self, name)!r}")
        if self.relay_poll_interval_s <= 0:
            raise ConfigError("OUTBOX_RELAY_POLL_INTERVAL_S must be > 0")
        if self.relay_confirm_mode not in ("confirm", "tx", "none"):
            raise ConfigError(
                f"OUTBOX_RELAY_CONFIRM_MODE must be confirm, tx or none, got {self.relay_confirm_mode!r}"
            )
        if not self.namespace or any(c in self.namespace for c in " /#*"):
            raise ConfigError(f"OUTBOX_NAMESPACE {self.namespace!r} must be non-empty, without ' /#*'")
        if self.consumer_retry_backoff_max_s >= self.broker_visibility_timeout_s:
            raise ConfigError(
                f"OUTBOX_CONSUMER_RETRY_BACKOFF_MAX_S ({self.consumer_retry_backoff_max_s}) must be below "
                f"OUTBOX_BROKER_VISIBILITY_TIMEOUT_S ({self.broker_visibility_timeout_s}): on Redis a retry "
                "waiting longer than the visibility timeout is delivered twice"
            )
        if self.relay_reconcile_after_ms <= self.broker_visibility_timeout_s * 1000:
            raise ConfigError(
                f"OUTBOX_RELAY_RECONCILE_AFTER_MS ({self.relay_reconcile_after_ms}) must exceed "
                f"OUTBOX_BROKER_VISIBILITY_TIMEOUT_S ({self.broker_visibility_timeout_s} s): the broker's own "
                "redelivery comes first, the reconciler only catches what is really lost"
            )
        check_prefix(self.table_prefix)
        url = self.database_url
        if url and not (url.startswith("sqlite") or url.startswith("postgresql")):
            raise ConfigError(f"OUTBOX_DATABASE_URL must be sqlite:// or postgresql://, got {url!r}")
        b = self.broker_url
        if b and not self.allows_broker_alias(b) and not b.startswith(("redis://", "rediss://", "redis+socket://", "amqp://",
                                               "pyamqp://", "amqps://", "memory://")):
            raise ConfigError(
                f"OUTBOX_BROKER_URL must be redis://... or amqp://..., got {b!r}"
            )


_TYPES: dict[str, type] = {"int": int, "float": float, "str": str}


def _coerce(key: str, raw: str, annotation: Any) -> Any:
    name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if name == "Path":
        return Path(raw)
    if name.startswith("Mapping"):
        return _parse_routes(raw)
    typ = _TYPES.get(name, str)
    try:
        return typ(raw)
    except ValueError:
        raise ConfigError(f"{key} must be {typ.__name__}, got {raw!r}") from None


def broker_is_rabbitmq(url: str) -> bool:
    return url.startswith(("amqp://", "pyamqp://", "amqps://"))
