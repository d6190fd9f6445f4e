"""The relay's adaptive choices: the batch size, and whether a wake-up waits to gather more commits.

``AdaptiveBatch``: a backlog is drained fastest in big batches (one claim, one confirm wait, one mark and one commit
for many rows); a trickle gains nothing from them. So the size starts at ``minimum``
(``relay_batch_size``), doubles after every full batch up to ``maximum`` (``relay_max_in_flight_rows``,
which bounds the rows published but not yet marked, i.e. the duplicates a crash can cause), and
halves after a batch that came back at most a quarter full.

``CommitRate``: a NOTIFY wake-up may wait ``relay_gather_ms`` so that one claim, publish, confirm wait
and mark serve the commits that arrive meanwhile. That pays only when several commits come within the
window; at a trickle (20 orders/s against a 20 ms window) the wait is latency for nothing. So the loop
counts the notifications it reads, decayed exponentially over ``horizon_s``, and gathers only while the
rate says at least a given number of commits (the loop's ``GATHER_MIN_COMMITS``) is expected within
the window.

Both are pure objects: the caller passes the time in, no I/O.
"""

from __future__ import annotations

import math

from celery_outbox.errors import ConfigError


class AdaptiveBatch:
    """The next batch size from the last one's fill; see the module docstring."""

    def __init__(self, *, minimum: int, maximum: int) -> None:
        if minimum < 1 or maximum < minimum:
            raise ConfigError(f"adaptive batch needs 1 <= minimum <= maximum, got {minimum} and {maximum}")
        self.minimum = minimum
        self.maximum = maximum
        self.size = minimum

    def observe(self, *, asked: int, claimed: int) -> int:
        """Record that a batch asked for ``asked`` rows got ``claimed``; return the next size.

        ``asked`` may be below ``size`` (the circuit breaker's probe batch): only a batch that asked
        for the full size and got it all says there is more to take.
        """
        if asked >= self.size and claimed >= asked:
            self.size = min(self.maximum, self.size * 2)
        elif claimed * 4 <= asked:
            self.size = max(self.minimum, self.size // 2)
        return self.size


class CommitRate:
    """Commits per second, from the notifications the relay reads; see the module docstring.

    An exponentially decayed count: each commit weighs ``exp(-age / horizon_s)``, so the count is about
    the commits of the last ``horizon_s`` and the rate is that count over ``horizon_s``. It follows a
    burst within a horizon and forgets it within a few.
    """

    def __init__(self, *, horizon_s: float = 1.0) -> None:
        if not horizon_s > 0 or math.isinf(horizon_s):
            raise ConfigError(f"commit rate horizon must be a positive number of seconds, got {horizon_s}")
        self.horizon_s = horizon_s
        self._count = 0.0
        self._at = 0.0

    def _decayed(self, at: float) -> float:
        age = at - self._at
        return self._count if age <= 0 else self._count * math.exp(-age / self.horizon_s)

    def add(self, commits: int, *, at: float) -> None:
        """Record ``commits`` notifications read at monotonic time ``at``."""
        self._count = self._decayed(at) + max(0, commits)
        self._at = max(self._at, at)

    def per_s(self, *, at: float) -> float:
        return self._decayed(at) / self.horizon_s

    def expects_more(self, window_s: float, *, at: float, commits: float = 1.0) -> bool:
        """Whether at least ``commits`` more commits are expected within ``window_s`` at the current rate."""
        return window_s > 0 and self.per_s(at=at) * window_s >= max(commits, 1.0)
