"""A worker warmed before its first message: what each process's first delivery would otherwise pay.

``Outbox`` adds ``warmup_step(outbox)`` to its app's worker boot steps. Without it, the first message a
worker process takes after a start or a deploy builds its consumers' delivery contexts, configures the ORM's
mappers, imports the tracing API and opens the process's first database connection, all while the message
waits; with several messages queued behind it, the first orders after a deploy wait for all of that.

- In the worker's main process, while the worker is built and before a prefork pool forks (so every pool
  process inherits what was done): the ORM's mappers configured, each consumer's and ``@outbox.task``'s
  delivery context built, the tracing API imported. CPU only; no database, no broker.
- In each process that runs deliveries (every prefork pool process as it starts; the main process of a
  solo or thread pool): one database connection opened and returned to the process's pool, in a daemon
  thread, so that neither the process's start (which Celery times) nor a database that is slow or away
  holds anything up. A connection that cannot be opened is logged once and opened at the first message,
  as before.

Nothing here is needed for correctness: a step that fails is logged and the worker runs as it would have.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import bootsteps, signals
from sqlalchemy.orm import configure_mappers

from celery_outbox import tracing
from celery_outbox.config.masking import mask_secrets

log = logging.getLogger(__name__)


def build_contexts(outbox: Any) -> None:
    """Build the delivery context of every consumer and idempotent task of ``outbox.app``."""
    for task in list(outbox.app.tasks.values()):
        sources = [getattr(task, "outbox_context", None), getattr(getattr(task, "outbox_batch_runner", None),
                                                                  "context", None)]
        for source in sources:
            if callable(source):
                source()


def warm_process(outbox: Any) -> None:
    """The CPU-only part: mappers, delivery contexts, the tracing API (failures logged, never raised)."""
    try:
        configure_mappers()
        tracing.preload()
        build_contexts(outbox)
    except Exception as e:  # a context that cannot be built now fails at its first message, as before
        log.warning("outbox: warming the worker before its first message failed (%s); the first message "
                    "does it", mask_secrets(f"{e.__class__.__name__}: {e}"))


def open_connection(outbox: Any) -> None:
    """Open one database connection for this process and return it to the process's pool."""
    try:
        with outbox.sessions()() as session:
            session.connection()
    except Exception as e:
        log.info("outbox: no database connection ahead of the first message (%s); the first message opens "
                 "it", mask_secrets(f"{e.__class__.__name__}: {e}"))


def open_connection_in_background(outbox: Any) -> threading.Thread:
    thread = threading.Thread(target=open_connection, args=(outbox,), name="outbox-warm-connection", daemon=True)
    thread.start()
    return thread


def warmup_step(outbox: Any) -> type[bootsteps.StartStopStep]:
    """A worker boot step that warms the main process as the worker is built (before the pool forks),
    and opens each delivering process's first database connection in the background."""

    def in_pool_process(**_: Any) -> None:
        open_connection_in_background(outbox)

    class OutboxWarmup(bootsteps.StartStopStep):
        requires = ("celery.worker.components:Pool",)  # type: ignore[assignment]

        def create(self, parent: Any) -> None:
            warm_process(outbox)  # built before the pool's start: prefork pool processes inherit it
            # weak=False: the worker holds the outbox for its whole life; the uid keeps one receiver per outbox
            signals.worker_process_init.connect(in_pool_process, weak=False,
                                                dispatch_uid=f"celery_outbox.warmup.{id(outbox)}")

        def start(self, parent: Any) -> None:
            # solo and thread pools deliver in this process; a prefork parent runs the gate and the registry
            open_connection_in_background(outbox)

    return OutboxWarmup
