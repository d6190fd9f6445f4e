"""Time as integer milliseconds from an injectable clock.

Every stored instant is ``int`` ms so tests can move time with freezegun (which patches
``time.time``) or pass a ``ManualClock`` and never sleep.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int: ...


class SystemClock:
    """Wall-clock time; freezegun's ``freeze_time`` controls it in tests."""

    def now_ms(self) -> int:
        return int(time.time() * 1000)


class ManualClock:
    """A clock a test moves by hand."""

    def __init__(self, *, start_ms: int = 1_700_000_000_000) -> None:
        self._now = start_ms

    def now_ms(self) -> int:
        return self._now

    def advance(self, ms: int) -> None:
        self._now += ms

    def set(self, ms: int) -> None:
        self._now = ms
