"""The relay's Celery tasks: ``celery_outbox.drain`` (beat, every poll interval) and ``celery_outbox.reconcile``.

The engine, publisher and breaker live in this closure, built lazily in the worker process that first
runs a task (never in a module global, never before a prefork fork).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from celery import Celery

from celery_outbox.celery import events
from celery_outbox.celery.config import DRAIN_TASK, RECONCILE_TASK, add_task_routes
from celery_outbox.celery.kombu_publisher import KombuPublisher
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.relay.reconcile import reconcile
from celery_outbox.runtime import Context


def relay_loop(ctx: Context, *, listen: bool, max_batches_per_drain: int = 10_000) -> RelayLoop:
    """A relay loop for ``ctx`` with a kombu publisher to its broker (the caller closes both)."""
    routes = ctx.routes()
    consumers = tuple(dict.fromkeys(c for names in routes.values() for c in names))
    publisher = KombuPublisher(broker_url=ctx.broker_url(), settings=ctx.settings, consumers=consumers)
    return RelayLoop(settings=ctx.settings, tables=ctx.tables, session_factory=ctx.sessions(), publisher=publisher,
                     clock=ctx.clock, crash_points=ctx.crash_points, listen=listen,
                     max_batches_per_drain=max_batches_per_drain, routes=routes)


def register(app: Celery, ctx: Context) -> None:
    """Define the drain and reconcile tasks on ``app``, routed to ``<namespace>.relay``."""
    lock = threading.Lock()
    cache: dict[str, RelayLoop] = {}

    def loop() -> RelayLoop:
        found = cache.get("loop")
        if found is None:
            found = cache["loop"] = relay_loop(ctx, listen=False, max_batches_per_drain=1_000)
        return found

    add_task_routes(app, {name: {"queue": f"{ctx.settings.namespace}.relay"} for name in (DRAIN_TASK, RECONCILE_TASK)})

    @app.task(name=DRAIN_TASK, ignore_result=True, shared=False)  # type: ignore[untyped-decorator]
    def drain_outbox() -> dict[str, Any]:
        """Publish every due outbox row now (one drain); the beat schedule calls it again."""
        with lock:
            result = loop().drain_once()
        for message_id, why in result.dead_lettered_rows:  # visible in Flower; best effort
            events.dead_lettered(app, source="outbox", message_id=message_id, error=why)
        return dataclasses.asdict(result)

    @app.task(name=RECONCILE_TASK, ignore_result=True, shared=False)  # type: ignore[untyped-decorator]
    def reconcile_outbox() -> dict[str, Any]:
        """Re-publish, per consumer, published events that consumer never recorded (relay/reconcile.py)."""
        relay = loop()
        settings = ctx.settings
        with lock, relay.session_factory() as session:
            result = reconcile(session, relay.publisher, relay.clock, tables=ctx.tables, routes=relay.routes,
                               namespace=settings.namespace, max_message_bytes=settings.max_message_bytes,
                               older_than_ms=settings.relay_reconcile_after_ms)
        return dataclasses.asdict(result)
