"""The relay-wide circuit breaker: open on an outage, probe with doubling backoff, close on success."""

from __future__ import annotations

import pytest

from celery_outbox.relay.breaker import BreakerState, CircuitBreaker


def test_opens_doubles_caps_and_closes() -> None:
    b = CircuitBreaker(base_ms=1_000, max_ms=5_000)
    assert b.state(0) is BreakerState.CLOSED and b.allow(0)
    b.record_failure(0, "refused")
    assert b.state(999) is BreakerState.OPEN and not b.allow(999)
    assert b.state(1_000) is BreakerState.HALF_OPEN and b.allow(1_000)
    delays = []
    for _ in range(5):
        b.record_failure(10_000, "refused")
        delays.append(b.wait_ms(10_000))
    assert delays == [2_000, 4_000, 5_000, 5_000, 5_000]
    assert b.opened_count == 1 and b.last_error == "refused"
    b.record_success()
    assert b.state(10_000) is BreakerState.CLOSED and b.wait_ms(10_000) == 0 and b.last_error is None


def test_half_open_probes_with_a_small_batch() -> None:
    b = CircuitBreaker(base_ms=100, max_ms=1_000, probe_batch_size=1)
    assert b.batch_limit(0, 500) == 500
    b.record_failure(0, "x")
    assert b.batch_limit(100, 500) == 1
    b.record_success()
    assert b.batch_limit(100, 500) == 500


def test_rejects_nonsense_configuration() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(base_ms=0)
    with pytest.raises(ValueError):
        CircuitBreaker(base_ms=10, max_ms=5)
