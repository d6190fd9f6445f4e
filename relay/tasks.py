"""The beat-scheduled relay task ``relay.tasks.drain_outbox`` (schedule in celeryconfig).

Registered by ``register(app, settings)`` (called by ``outbox.celery_app.create_celery_app``), with
the engine, publisher and breaker cached in this closure, built lazily in the worker process that
first runs the task (never in a module global, never before a prefork fork).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from celeryconfig import Settings, add_task_routes
from outbox import events
from outbox.clock import SystemClock
from outbox.crashpoints import CrashPoints
from outbox.db import make_engine, make_session_factory
from outbox.embedded import resolve_broker_url
from relay.kombu_publisher import KombuPublisher
from relay.loop import RelayLoop
from relay.reconcile import reconcile

TASK_NAME = "relay.tasks.drain_outbox"
RECONCILE_TASK = "relay.tasks.reconcile"


def register(app: Any, settings: Settings) -> None:
    """Define ``relay.tasks.drain_outbox`` on ``app``: drain the outbox with ``dispatch_batch``."""
    lock = threading.Lock()
    cache: dict[str, RelayLoop] = {}

    def relay_loop() -> RelayLoop:
        loop = cache.get("loop")
        if loop is None:
            engine = make_engine(settings.effective_database_url)
            broker_url = app.conf.broker_url or resolve_broker_url(settings.broker_url, home=settings.home)
            publisher = KombuPublisher(broker_url=broker_url, settings=settings)
            loop = RelayLoop(settings=settings, session_factory=make_session_factory(engine), publisher=publisher,
                             clock=SystemClock(), crash_points=CrashPoints(spec=settings.crash_points),
                             listen=False, max_batches_per_drain=1_000)
            cache["loop"] = loop
        return loop

    add_task_routes(app, {name: {"queue": f"{settings.namespace}.relay"} for name in (TASK_NAME, RECONCILE_TASK)})

    @app.task(name=TASK_NAME, ignore_result=True, shared=False)  # type: ignore[untyped-decorator]
    def drain_outbox() -> dict[str, Any]:
        """Publish every due outbox row now (one drain); the beat schedule calls it again."""
        with lock:
            result = relay_loop().drain_once()
        for message_id, why in result.dead_lettered_rows:  # visible in Flower; best effort
            events.dead_lettered(app, source="outbox", message_id=message_id, error=why)
        return dataclasses.asdict(result)

    @app.task(name=RECONCILE_TASK, ignore_result=True, shared=False)  # type: ignore[untyped-decorator]
    def reconcile_outbox() -> dict[str, Any]:
        """Re-publish, per consumer, published events that consumer never recorded (relay/reconcile.py)."""
        loop = relay_loop()
        with lock, loop.session_factory() as session:
            result = reconcile(session, loop.publisher, loop.clock, routes=settings.routes,
                               namespace=settings.namespace, max_message_bytes=settings.max_message_bytes,
                               older_than_ms=settings.relay_reconcile_after_ms)
        return dataclasses.asdict(result)
