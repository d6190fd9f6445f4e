"""What the Celery binding, the CLI and the web contrib need of an outbox: a small protocol.

``Outbox`` implements it; keeping it a protocol here lets those layers depend on the core only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from celery_outbox.clock import Clock
from celery_outbox.crashpoints import CrashPoints
from celery_outbox.db import SessionSource
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings


class Context(Protocol):
    settings: Settings
    sessions: SessionSource
    clock: Clock
    crash_points: CrashPoints

    @property
    def tables(self) -> Tables: ...

    def routes(self) -> Mapping[str, tuple[str, ...]]:
        """Event type -> consumer names, as the relay publishes them now."""
        ...

    def known_consumers(self) -> tuple[str, ...]: ...

    def idempotent_tasks(self) -> frozenset[str]:
        """Names of the ``@outbox.task`` tasks: the reconciler checks their inbox rows."""
        ...

    def broker_url(self) -> str: ...
