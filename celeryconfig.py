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
            "relay_breaker_base_ms", "relay_breaker_max_ms", "max_message_bytes", "relay_reconcile_after_ms",
            "relay_reconcile_interval_s",
            "consumer_max_deliveries", "worker_concurrency", "broker_visibility_timeout_s",
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


def add_task_routes(app: Any, routes: Mapping[str, Mapping[str, str]]) -> None:
    """Route these tasks to their queues (``send_task``, retries), keeping routes others set."""
    existing = app.conf.task_routes
    if not existing:
        app.conf.task_routes = dict(routes)
    elif isinstance(existing, Mapping):
        app.conf.task_routes = {**existing, **routes}
    else:  # a sequence of routers: ours first
        app.conf.task_routes = (dict(routes), *tuple(existing))


def redis_transport_options(settings: Settings) -> dict[str, Any]:
    """Redelivery of unacked messages on Redis, sized from one setting.

    kombu restores a dead worker's unacked messages after ``visibility_timeout``, under a mutex kept
    in Redis; a worker SIGKILLed while holding it blocks every restore until the mutex expires (300 s
    by default), so the mutex expiry follows the timeout instead of staying fixed.
    """
    vt = settings.broker_visibility_timeout_s
    return {
        "visibility_timeout": vt,
        "unacked_restore_interval": max(1, min(60, vt // 3)),
        "unacked_mutex_expire": max(5, min(300, vt * 2)),
    }


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
        # After a reconnect Celery lowers the prefetch count and raises it back as in-flight tasks
        # ack; acks of tasks delivered on the dead connection fail, and a worker was seen stuck,
        # consuming nothing, after a RabbitMQ outage (chaos run; celery/celery#9512). Prefetch is 1
        # per process here, so there is nothing to protect by reducing it.
        "worker_enable_prefetch_count_reduction": False,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "task_queues": [*queues, relay_queue],
        "task_default_queue": relay_queue.name,
        "task_default_exchange": relay_queue.exchange.name,
        "task_default_routing_key": relay_queue.routing_key,
        "task_create_missing_queues": False,
        "broker_transport_options": {"confirm_publish": True}
        if broker_is_rabbitmq(broker_url)
        else redis_transport_options(settings),
        "beat_schedule": {
            "drain-outbox": {
                "task": "relay.tasks.drain_outbox",
                "schedule": settings.relay_poll_interval_s,
                "options": {"queue": relay_queue.name, "expires": max(settings.relay_poll_interval_s, 1.0)},
            },
            "reconcile-outbox": {  # relay/reconcile.py: re-send what a consumer never recorded
                "task": "relay.tasks.reconcile", "schedule": settings.relay_reconcile_interval_s,
                "options": {"queue": relay_queue.name, "expires": settings.relay_reconcile_interval_s},
            },
            "prune-retention": {  # ops.tasks: hourly, inbox kept >= broker_redelivery_window_ms
                "task": "ops.tasks.prune", "schedule": 3600.0,
                "options": {"queue": relay_queue.name, "expires": 3600.0},
            },
        },
        "beat_schedule_filename": str((settings.home / "celerybeat-schedule").resolve()),
        "worker_hijack_root_logger": False,
    }
