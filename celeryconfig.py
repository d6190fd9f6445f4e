"""All settings, read from the environment once, and the Celery/Kombu configuration derived from them.

``Settings.from_env()`` is the only place that reads ``OUTBOX_*`` variables; everything else takes a
``Settings`` (or the few values it needs) as an argument. Celery loads this module with
``app.config_from_object("celeryconfig")`` and reads the lowercase names at the bottom.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outbox.errors import ConfigError

DEFAULT_ROUTES: dict[str, tuple[str, ...]] = {
    "OrderPlaced": ("shipping", "billing", "search", "email"),
}

EMBEDDED = "embedded"


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
    """Every knob of the system, with the embedded defaults (SQLite + an embedded real Redis)."""

    home: Path = Path("var")
    database_url: str = ""  # empty: sqlite file under ``home``
    broker_url: str = EMBEDDED  # "embedded": start/reuse the embedded Redis under ``home``
    namespace: str = "outbox"  # prefix of exchange and queue names
    routes: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: dict(DEFAULT_ROUTES))

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

    consumer_max_deliveries: int = 3
    consumer_retry_backoff_s: int = 1
    consumer_retry_backoff_max_s: int = 60
    consumer_park_timeout_ms: int = 600_000
    broker_redelivery_window_ms: int = 24 * 3600 * 1000
    worker_concurrency: int = 2

    metrics_port: int = 0  # worker /metrics port; 0 = off (the Flask app always serves /metrics)
    admin_token: str = ""
    crash_points: str = ""  # comma separated names armed for chaos tests

    @property
    def effective_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.home / 'outbox.db').resolve()}"

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

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Build settings from ``OUTBOX_<FIELD>`` variables; a malformed value raises ``ConfigError``."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = f"OUTBOX_{f.name.upper()}"
            if key not in env:
                continue
            raw = env[key]
            values[f.name] = _coerce(key, raw, f.type)
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        positive = (
            "relay_batch_size", "relay_max_attempts", "relay_base_delay_ms", "relay_max_delay_ms",
            "relay_breaker_base_ms", "relay_breaker_max_ms", "max_message_bytes",
            "consumer_max_deliveries", "worker_concurrency",
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
        url = self.effective_database_url
        if not (url.startswith("sqlite") or url.startswith("postgresql")):
            raise ConfigError(f"OUTBOX_DATABASE_URL must be sqlite:// or postgresql://, got {url!r}")
        b = self.broker_url
        if b != EMBEDDED and not b.startswith(("redis://", "rediss://", "redis+socket://", "amqp://",
                                               "pyamqp://", "amqps://", "memory://")):
            raise ConfigError(
                f"OUTBOX_BROKER_URL must be 'embedded', redis://... or amqp://..., got {b!r}"
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


def celery_config(settings: Settings, broker_url: str) -> dict[str, Any]:
    """The Celery configuration for these settings. ``broker_url`` is already resolved (no 'embedded')."""
    from kombu import Exchange, Queue

    exchange = Exchange(settings.exchange_name, type="direct", durable=True)
    queues = [
        Queue(settings.queue_name(c), exchange, routing_key=settings.queue_name(c), durable=True)
        for c in settings.consumers
    ]
    relay_queue = Queue(f"{settings.namespace}.relay", Exchange(f"{settings.namespace}.relay"),
                        routing_key=f"{settings.namespace}.relay", durable=True)
    return {
        "broker_url": broker_url,
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_ignore_result": True,
        "result_backend": None,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "task_queues": [*queues, relay_queue],
        "task_default_queue": relay_queue.name,
        "task_default_exchange": relay_queue.exchange.name,
        "task_default_routing_key": relay_queue.routing_key,
        "task_create_missing_queues": False,
        "broker_transport_options": {"visibility_timeout": 3600, "confirm_publish": True}
        if broker_is_rabbitmq(broker_url)
        else {"visibility_timeout": 3600},
        "beat_schedule": {
            "drain-outbox": {
                "task": "relay.tasks.drain_outbox",
                "schedule": settings.relay_poll_interval_s,
                "options": {"queue": relay_queue.name, "expires": max(settings.relay_poll_interval_s, 1.0)},
            },
            "prune-retention": {  # ops.tasks: hourly, inbox kept >= broker_redelivery_window_ms
                "task": "ops.tasks.prune", "schedule": 3600.0,
                "options": {"queue": relay_queue.name, "expires": 3600.0},
            },
        },
        "beat_schedule_filename": str((settings.home / "celerybeat-schedule").resolve()),
        "worker_hijack_root_logger": False,
    }
