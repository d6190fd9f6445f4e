"""The relay's adaptive batch size: grow while batches come back full, shrink when the outbox is idle.

A backlog is drained fastest in big batches (one claim, one confirm wait, one mark and one commit
for many rows); a trickle gains nothing from them. So the size starts at ``minimum``
(``relay_batch_size``), doubles after every full batch up to ``maximum`` (``relay_max_in_flight_rows``,
which bounds the rows published but not yet marked, i.e. the duplicates a crash can cause), and
halves after a batch that came back at most a quarter full. A pure object: no clock, no I/O.
"""

from __future__ import annotations

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
