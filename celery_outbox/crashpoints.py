"""Named crash points for chaos tests: ``OUTBOX_CRASH_POINTS=after_publish_before_mark`` makes the
process SIGKILL itself exactly there. Disarmed, a crash point is one frozenset lookup.

``OUTBOX_CRASH_POINTS`` is read when a ``CrashPoints`` is built: comma-separated ``name`` or
``name@N``, which fires on the N-th time the point is reached (default 1), so a run can get some work
done before dying. N is ASCII digits, 1 to 999,999,999; an unknown name, a malformed N or a point
armed twice is a ``ConfigError`` (a chaos run that silently dies at the wrong place proves nothing).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping

from celery_outbox.errors import ConfigError

KNOWN = frozenset({
    "after_order_commit",
    "after_enqueue_commit",  # an application process that enqueued tasks (tests/chaos/test_task_crashes.py)
    # On Postgres a drain's first batch is stamped published by its claim, in the transaction that commits after
    # the confirm (relay/dispatch.py): killed at either point below, that transaction dies uncommitted, so the
    # rows are pending as before, and "before mark" means before the COMMIT that marks them.
    "after_claim_before_publish",
    "after_publish_before_mark",
    # the pipelined relay (relay/loop.py): batch N on the wire, unconfirmed and unmarked, batch N+1 claimed
    "relay_in_flight_next_claimed",
    "after_mark",
    "consumer_before_commit",
    "consumer_after_commit_before_ack",
})


_ITEM = re.compile(r"([^@]*)(?:@(.*))?", re.DOTALL)
_NTH = re.compile(r"[1-9][0-9]{0,8}", re.ASCII)


class CrashPoints:
    """Parsed ``OUTBOX_CRASH_POINTS``; ``reached(name)`` kills the process when that point is armed."""

    def __init__(self, *, spec: str = "") -> None:
        self._armed: dict[str, int] = {}
        self._hits: dict[str, int] = {}
        for item in filter(None, (p.strip() for p in spec.split(","))):
            m = _ITEM.fullmatch(item)
            assert m is not None  # the pattern matches any text
            name, nth = m.group(1).strip(), m.group(2)
            if name not in KNOWN:
                raise ConfigError(f"unknown crash point {_short(name)}; known: {', '.join(sorted(KNOWN))}")
            if nth is not None and not _NTH.fullmatch(nth.strip()):
                raise ConfigError(f"{_short(item)} is not NAME@N with N from 1 to 999999999 in ASCII digits")
            if name in self._armed:
                raise ConfigError(f"crash point {name!r} is armed twice")
            self._armed[name] = int(nth) if nth is not None else 1
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


def _short(text: str, limit: int = 60) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[:limit] + "...(truncated)"


DISARMED = CrashPoints()
