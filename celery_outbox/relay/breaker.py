"""Relay-wide circuit breaker: when the broker is unreachable, stop hammering it and probe with backoff.

A broker outage is nobody's message's fault, so it is not charged to rows (that would dead-letter a
peak hour's orders); instead the whole relay backs off. States: closed (publish freely), open (do
not publish before ``retry_at_ms``), half-open (one small probe batch allowed; success closes,
failure re-opens with a doubled delay, capped).
"""

from __future__ import annotations

import enum


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Exponential relay-wide backoff: ``base_ms * 2**(failures-1)``, capped at ``max_ms``."""

    def __init__(self, *, base_ms: int = 1_000, max_ms: int = 60_000, probe_batch_size: int = 1) -> None:
        if base_ms <= 0 or max_ms < base_ms or probe_batch_size <= 0:
            raise ValueError("need 0 < base_ms <= max_ms and probe_batch_size > 0")
        self.base_ms = base_ms
        self.max_ms = max_ms
        self.probe_batch_size = probe_batch_size
        self.failures = 0
        self.retry_at_ms: int | None = None
        self.last_error: str | None = None
        self.opened_count = 0

    def state(self, now_ms: int) -> BreakerState:
        if self.retry_at_ms is None:
            return BreakerState.CLOSED
        return BreakerState.OPEN if now_ms < self.retry_at_ms else BreakerState.HALF_OPEN

    def allow(self, now_ms: int) -> bool:
        """May the relay publish now? False only while open."""
        return self.state(now_ms) is not BreakerState.OPEN

    def batch_limit(self, now_ms: int, batch_size: int) -> int:
        """A half-open breaker probes with a small batch; closed publishes full batches."""
        if self.state(now_ms) is BreakerState.HALF_OPEN:
            return min(batch_size, self.probe_batch_size)
        return batch_size

    def delay_ms(self) -> int:
        if self.failures <= 0:
            return 0
        delay: int = self.base_ms * 2 ** min(self.failures - 1, 62)
        return min(self.max_ms, delay)

    def record_failure(self, now_ms: int, error: str) -> None:
        if self.retry_at_ms is None:
            self.opened_count += 1
        self.failures += 1
        self.last_error = error
        self.retry_at_ms = now_ms + self.delay_ms()

    def record_success(self) -> None:
        self.failures = 0
        self.retry_at_ms = None
        self.last_error = None

    def wait_ms(self, now_ms: int) -> int:
        """How long until a probe is allowed (0 when closed or half-open)."""
        if self.retry_at_ms is None:
            return 0
        return max(0, self.retry_at_ms - now_ms)
