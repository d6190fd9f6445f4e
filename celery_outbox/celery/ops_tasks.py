"""Retention as a Celery task (``celery_outbox.prune``, hourly under beat) and the worker's ``/metrics`` server."""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import worker_ready

from celery_outbox.celery.config import PRUNE_TASK
from celery_outbox.celery.queue_depth import queue_probe
from celery_outbox.ops import retention
from celery_outbox.ops.metrics import make_registry, start_worker_metrics_server
from celery_outbox.ops.schedule import PRUNE_EVERY_S, scheduled_prune
from celery_outbox.relay import lease
from celery_outbox.runtime import Context
from celery_outbox.settings import Settings

__all__ = ["beat_entry", "register"]


def beat_entry(settings: Settings) -> dict[str, Any]:
    """The beat schedule entry for hourly retention on the relay queue."""
    return {
        "task": PRUNE_TASK,
        "schedule": PRUNE_EVERY_S,
        "options": {"queue": f"{settings.namespace}.relay", "expires": PRUNE_EVERY_S},
    }


def register(app: Celery, ctx: Context) -> None:
    settings = ctx.settings
    state: dict[str, Any] = {}

    def sessions() -> Any:
        return ctx.sessions()

    prune_lease = lease.timer_lease(lease.PRUNE, interval_s=PRUNE_EVERY_S)

    @app.task(name=PRUNE_TASK, ignore_result=True, acks_late=True, shared=False)  # type: ignore[untyped-decorator]
    def prune(inbox_older_than_ms: int | None = None, published_older_than_ms: int | None = None,
              batch: int = retention.DEFAULT_BATCH) -> dict[str, int | str | None]:
        """Retention; the inbox default never goes below the broker redelivery window.

        Called as beat calls it (no ages), it is the hourly job and runs only when it wins the
        ``prune`` lease (relay/lease.py), shared with every standalone relay: once per hour in all.
        Called with an age, it is a one-off prune and runs at once."""
        scheduled = inbox_older_than_ms is None and published_older_than_ms is None
        if scheduled and not prune_lease.claim(sessions(), ctx.clock, tables=ctx.tables):
            return {"skipped": "not due: this hour's pass ran elsewhere"}
        return {**scheduled_prune(sessions(), settings=settings, tables=ctx.tables, clock=ctx.clock,
                                  inbox_older_than_ms=inbox_older_than_ms,
                                  published_older_than_ms=published_older_than_ms, batch=batch).to_dict()}

    if settings.metrics_port > 0:
        def _serve_metrics(sender: Any = None, **_kw: Any) -> None:
            if getattr(sender, "app", app) is not app:
                return
            registry = make_registry(tables=ctx.tables, session_factory=sessions(), queue_probe=queue_probe(ctx))
            state["metrics_server"] = start_worker_metrics_server(port=settings.metrics_port, registry=registry)

        worker_ready.connect(_serve_metrics, weak=False)
