"""Retention as a Celery task (``celery_outbox.prune``, hourly under beat) and the worker's ``/metrics`` server."""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import worker_ready

from celery_outbox.celery.config import PRUNE_TASK
from celery_outbox.ops import retention
from celery_outbox.ops.metrics import make_registry, start_worker_metrics_server
from celery_outbox.runtime import Context
from celery_outbox.settings import Settings

DEFAULT_INBOX_RETENTION_MS = 7 * 24 * 3600 * 1000
DEFAULT_PUBLISHED_RETENTION_MS = 24 * 3600 * 1000
PRUNE_EVERY_S = 3600.0


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

    @app.task(name=PRUNE_TASK, ignore_result=True, acks_late=True, shared=False)  # type: ignore[untyped-decorator]
    def prune(inbox_older_than_ms: int | None = None, published_older_than_ms: int | None = None,
              batch: int = retention.DEFAULT_BATCH) -> dict[str, int | None]:
        """Retention; the inbox default never goes below the broker redelivery window."""
        inbox = inbox_older_than_ms if inbox_older_than_ms is not None else max(
            DEFAULT_INBOX_RETENTION_MS, settings.broker_redelivery_window_ms)
        published = published_older_than_ms if published_older_than_ms is not None \
            else DEFAULT_PUBLISHED_RETENTION_MS
        return retention.prune(sessions(), tables=ctx.tables, inbox_older_than_ms=inbox, published_older_than_ms=published,
                               batch=batch, clock=ctx.clock,
                               redelivery_window_ms=settings.broker_redelivery_window_ms).to_dict()

    if settings.metrics_port > 0:
        def _serve_metrics(sender: Any = None, **_kw: Any) -> None:
            if getattr(sender, "app", app) is not app:
                return
            registry = make_registry(tables=ctx.tables, session_factory=sessions())
            state["metrics_server"] = start_worker_metrics_server(port=settings.metrics_port, registry=registry)

        worker_ready.connect(_serve_metrics, weak=False)
