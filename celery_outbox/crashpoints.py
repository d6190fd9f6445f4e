"""Named crash points for chaos tests: ``OUTBOX_CRASH_POINTS=after_publish_before_mark`` makes the
process SIGKILL itself exactly there. Disarmed, a crash point is one frozenset lookup.

``OUTBOX_CRASH_POINTS`` is read when a ``CrashPoints`` is built; a spec ``name@N`` fires on the
N-th time the point is reached (default 1), so a run can get some work done before dying.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

KNOWN = frozenset({
    "after_order_commit",
    "after_enqueue_commit",  # an application process that enqueued tasks (tests/chaos/test_task_crashes.py)
    "after_claim_before_publish",
    "after_publish_before_mark",
    # the pipelined relay (relay/loop.py): batch N on the wire, unconfirmed and unmarked, batch N+1 claimed
    "relay_in_flight_next_claimed",
    "after_mark",
    "consumer_before_commit",
    "consumer_after_commit_before_ack",
})


class CrashPoints:
    """Parsed ``OUTBOX_CRASH_POINTS``; ``reached(name)`` kills the process when that point is armed."""

    def __init__(self, *, spec: str = "") -> None:
        self._armed: dict[str, int] = {}
        self._hits: dict[str, int] = {}
        for item in filter(None, (p.strip() for p in spec.split(","))):
            name, _, nth = item.partition("@")
            if name not in KNOWN:
                from celery_outbox.errors import ConfigError

                raise ConfigError(f"unknown crash point {name!r}; known: {', '.join(sorted(KNOWN))}")
            self._armed[name] = int(nth) if nth.isdigit() and int(nth) > 0 else 1
        self.armed = frozenset(self._armed)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CrashPoints:
        env = os.environ if environ is None else environ
        return cls(spec=env.get("OUTBOX_CRASH_POINTS", ""))

    def reached(self, name: str) -> None:
        if name not in self.armed:
            return
        hits = self._hits.get(name, 0) + 1
        self._hits[name] = hits
        if hits >= self._armed[name]:
            os.kill(os.getpid(), signal.SIGKILL)


DISARMED = CrashPoints()
