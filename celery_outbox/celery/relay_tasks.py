"""The relay's Celery tasks: ``celery_outbox.drain`` (beat, every poll interval) and ``celery_outbox.reconcile``.

The engine, publisher and breaker live in this closure, built lazily in the worker process that first
runs a task (never in a module global, never before a prefork fork).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery

from celery_outbox.celery import events
from celery_outbox.celery.config import DRAIN_TASK, RECONCILE_TASK, add_task_routes, sentinel_options
from celery_outbox.celery.kombu_publisher import KombuPublisher
from celery_outbox.celery.queue_inspector import KombuQueueInspector
from celery_outbox.db import is_missing_table, missing_tables_hint
from celery_outbox.errors import DatabaseError
from celery_outbox.relay import lease
from celery_outbox.relay.loop import DrainResult, RelayLoop
from celery_outbox.relay.reconcile import ReconcileResult, reconcile
from celery_outbox.runtime import Context


def announce_drain(app: Celery, result: DrainResult, *, hostname: str | None = None,
                   task_id: str | None = None) -> None:
    """One ``outbox-dead-lettered`` event per outbox row this drain dead-lettered (best effort)."""
    for message_id, why in result.dead_lettered_rows:
        events.dead_lettered(app, source="outbox", message_id=message_id, error=why, hostname=hostname,
                             task_id=task_id)


def drain_announcer(app: Celery) -> Callable[[DrainResult], None]:
    """``RelayLoop.on_drain`` for the standalone relay: its dead letters as events under ``outbox-relay@host``."""
    hostname = events.relay_hostname()
    return lambda result: announce_drain(app, result, hostname=hostname)


MAX_RECONCILED_EVENTS = 1000  # per pass: a mass loss is counted in full (stats, metrics), not one event each


def announce_reconcile(app: Celery, result: ReconcileResult, *, hostname: str | None = None,
                       task_id: str | None = None) -> None:
    """One ``outbox-reconciled`` event per message a reconcile pass sent again (best effort, at most
    ``MAX_RECONCILED_EVENTS`` a pass; the counters have them all)."""
    for sent in result.resent[:MAX_RECONCILED_EVENTS]:
        events.reconciled(app, kind=sent.kind, message_id=sent.message_id, target=sent.target, hostname=hostname,
                          task_id=task_id)


def reconcile_announcer(app: Celery) -> Callable[[ReconcileResult], None]:
    """``RelayLoop.on_reconcile`` for the standalone relay: what it re-sent, as events under ``outbox-relay@host``."""
    hostname = events.relay_hostname()
    return lambda result: announce_reconcile(app, result, hostname=hostname)


def drain_summary(result: DrainResult) -> dict[str, Any]:
    """What the drain task returns (Flower shows it as the task's result): the drain's counts."""
    summary = dataclasses.asdict(result)
    del summary["dead_lettered_rows"]  # one event each (announce_drain), not a list in every result
    return summary


def relay_loop(ctx: Context, *, listen: bool, max_batches_per_drain: int = 10_000) -> RelayLoop:
    """A relay loop for ``ctx`` with a kombu publisher to its broker (the caller closes both)."""
    routes = ctx.routes()
    consumers = tuple(dict.fromkeys(c for names in routes.values() for c in names))
    url = ctx.broker_url()
    app = getattr(ctx, "app", None)  # a Celery app's own broker_transport_options may name the Sentinel master
    app_options = app.conf.broker_transport_options if isinstance(app, Celery) else None
    options = sentinel_options(ctx.settings, url, app_options)
    publisher = KombuPublisher(broker_url=url, settings=ctx.settings, consumers=consumers, transport_options=options)
    return RelayLoop(settings=ctx.settings, tables=ctx.tables, session_factory=ctx.sessions(), publisher=publisher,
                     clock=ctx.clock, crash_points=ctx.crash_points, listen=listen,
                     max_batches_per_drain=max_batches_per_drain, routes=routes,
                     idempotent_tasks=ctx.idempotent_tasks(), on_reconcile=reconcile_announcer_for(ctx),
                     queues=KombuQueueInspector(broker_url=url, transport_options=options))


def reconcile_announcer_for(ctx: Context) -> Callable[[ReconcileResult], None] | None:
    app = getattr(ctx, "app", None)
    return reconcile_announcer(app) if isinstance(app, Celery) else None


@contextmanager
def tables_named(ctx: Context) -> Iterator[None]:
    """A task failing on a database without the outbox tables says, in the first line of the worker's log entry,
    which command makes them; any other error passes as it is."""
    try:
        yield
    except DatabaseError as e:
        if not is_missing_table(e):
            raise
        lines = str(e).strip().splitlines()
        raise DatabaseError(f"{lines[0] if lines else type(e).__name__} ({missing_tables_hint(ctx)})") from e


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

    @app.task(name=DRAIN_TASK, bind=True, ignore_result=True, shared=False)  # type: ignore[untyped-decorator]
    def drain_outbox(self: Any) -> dict[str, Any]:
        """Publish every due outbox row now (one drain); the beat schedule calls it again.

        Its result (in Flower: the task's result) is the drain's counts; each row it dead-letters is an
        ``outbox-dead-lettered`` event from this worker's node name."""
        with lock, tables_named(ctx):
            result = loop().drain_once()
        announce_drain(app, result, **events.task_sender(self))
        return drain_summary(result)

    reconcile_lease = lease.timer_lease(lease.RECONCILE, interval_s=ctx.settings.relay_reconcile_interval_s)

    @app.task(name=RECONCILE_TASK, bind=True, ignore_result=True, shared=False)  # type: ignore[untyped-decorator]
    def reconcile_outbox(self: Any) -> dict[str, Any]:
        """Re-publish what never arrived (relay/reconcile.py): per consumer, events that consumer never
        recorded; ``@outbox.task`` messages with no inbox row; plain task messages with no receipt.

        Runs only when it wins the ``reconcile`` lease (relay/lease.py), shared with every standalone
        relay on the database: one pass per interval in all, however many run. Its result (Flower) is
        the pass's counts per kind; each message sent again is an ``outbox-reconciled`` event."""
        relay = loop()
        settings = ctx.settings
        with lock, tables_named(ctx):
            if not reconcile_lease.claim(relay.session_factory, relay.clock, tables=ctx.tables):
                return {"skipped": "not due: this interval's pass ran elsewhere"}
        with lock, relay.session_factory() as session:
            result = reconcile(session, relay.publisher, relay.clock, tables=ctx.tables, routes=relay.routes,
                               namespace=settings.namespace, max_message_bytes=settings.max_message_bytes,
                               older_than_ms=settings.relay_reconcile_after_ms,
                               idempotent_tasks=relay.idempotent_tasks,
                               plain_older_than_ms=settings.relay_reconcile_plain_tasks_after_ms,
                               queues=relay.queues, publish_skew_ms=relay.publish_skew_ms)
        announce_reconcile(app, result, **events.task_sender(self))
        return result.to_dict()
