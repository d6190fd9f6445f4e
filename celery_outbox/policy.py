"""A consumer's redelivery policy, spelled with the options of Celery's ``@app.task``.

``max_retries`` is the number of redeliveries after the first delivery; the next failure sends the
message to the dead-letter store. Unlike Celery's ``request.retries``, every delivery is counted in
the database, so deliveries lost with a killed worker count too (docs/design.md, rule 7).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from celery_outbox.errors import ConfigError
from celery_outbox.settings import Settings


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """A policy with every default filled in from the settings."""

    max_deliveries: int
    base_s: float
    max_s: float
    exponential: bool = True
    jitter: bool = False

    def delay_s(self, deliveries: int) -> float:
        """The countdown before the redelivery that follows ``deliveries`` failed deliveries."""
        delay = self.base_s * 2 ** min(max(0, deliveries - 1), 62) if self.exponential else self.base_s
        delay = float(min(self.max_s, delay))
        return random.uniform(0, delay) if self.jitter else delay


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """``None`` means: the value from ``Settings`` (``consumer_max_deliveries`` and the backoff knobs)."""

    max_retries: int | None = None
    retry_backoff: bool | float = True
    retry_backoff_max: float | None = None
    retry_jitter: bool = False

    def __post_init__(self) -> None:
        if self.max_retries is not None and (isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int)
                                             or self.max_retries < 0):
            raise ConfigError(f"max_retries must be an integer >= 0, got {self.max_retries!r}")
        rb = self.retry_backoff
        if not isinstance(rb, bool) and (not isinstance(rb, (int, float)) or not math.isfinite(rb) or rb <= 0):
            raise ConfigError(f"retry_backoff must be True, False or a number of seconds > 0, got {rb!r}")
        rm = self.retry_backoff_max
        if rm is not None and (isinstance(rm, bool) or not isinstance(rm, (int, float)) or not math.isfinite(rm)
                               or rm <= 0):
            raise ConfigError(f"retry_backoff_max must be a number of seconds > 0, got {rm!r}")

    def resolve(self, settings: Settings, *, broker_url: str | None = None) -> Backoff:
        """The backoff on ``settings``; ``broker_url`` (default: the settings') says whether Redis's
        visibility timeout bounds the longest wait (it means nothing on RabbitMQ)."""
        base = float(settings.consumer_retry_backoff_s)
        if not isinstance(self.retry_backoff, bool):
            base = float(self.retry_backoff)
        max_s = float(self.retry_backoff_max if self.retry_backoff_max is not None
                      else settings.consumer_retry_backoff_max_s)
        on_redis = settings.kind_of_broker(settings.broker_url if broker_url is None else broker_url) == "redis"
        if on_redis and max_s >= settings.broker_visibility_timeout_s:
            raise ConfigError(
                f"retry_backoff_max ({max_s} s) must be below OUTBOX_BROKER_VISIBILITY_TIMEOUT_S "
                f"({settings.broker_visibility_timeout_s} s): on Redis a retry waiting longer is delivered twice")
        deliveries = settings.consumer_max_deliveries if self.max_retries is None else self.max_retries + 1
        return Backoff(max_deliveries=deliveries, base_s=base, max_s=max_s,
                       exponential=self.retry_backoff is not False, jitter=self.retry_jitter)
