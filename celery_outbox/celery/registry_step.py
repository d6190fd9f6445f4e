"""The worker side of the worker registry (celery_outbox/workers.py): deploy-safe publishing.

``Outbox`` adds ``registry_step(outbox)`` to its app's worker boot steps, so every ``celery worker`` of
that app writes which queues it consumes and which task names (with their versions) it runs when it
starts, refreshes the row every ``OUTBOX_WORKER_HEARTBEAT_MS`` from a daemon thread (one UPDATE of one
row), and deletes it at a warm shutdown. The relay holds a task row that a live worker of its queue
cannot run (docs/scheduled.md, "Deploys"). A database that is away is logged, never fatal: the worker
runs as before, and its row expires, so the relay stops holding for it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

from celery import bootsteps

from celery_outbox import workers
from celery_outbox.db import is_missing_table, missing_tables_hint
from celery_outbox.runtime import Context

log = logging.getLogger(__name__)


def task_versions(app: Any) -> dict[str, int]:
    """The task names ``app`` runs with their versions (``outbox_task_version``, 1 when unset); Celery's own
    ``celery.*`` tasks and the library's own ``celery_outbox.*`` ones are left out (every worker runs them)."""
    out: dict[str, int] = {}
    for name, task in app.tasks.items():
        if name.startswith(("celery.", "celery_outbox.")):
            continue
        version = getattr(task, "outbox_task_version", None)
        out[name] = version if isinstance(version, int) and not isinstance(version, bool) and version > 0 else 1
    return out


def consumed_queues(app: Any) -> list[str]:
    """The queues this worker consumes (``-Q``, else every queue the app declares)."""
    queues = app.amqp.queues
    chosen = queues.consume_from if queues.consume_from else queues
    return sorted(str(name) for name in chosen)


def why(error: Exception, outbox: Any) -> str:
    """``error`` in one line for the worker's log (a driver's message goes on with the SQL it ran); a table that
    does not exist names the command that makes the outbox tables (``Outbox.schema_command``)."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    if is_missing_table(error):
        text += f" ({missing_tables_hint(outbox)})"
    return text


class Heartbeat:
    """Registers one worker, refreshes its row on a daemon thread, and unregisters it at ``stop``."""

    def __init__(self, outbox: Any, *, hostname: str) -> None:
        self.ctx: Context = outbox
        self.outbox = outbox
        self.app = outbox.app
        self.worker = uuid.uuid4()  # one row per worker start: a restart never revives a stale row
        self.name = hostname
        self.interval_s = outbox.settings.worker_heartbeat_ms / 1000.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._registered = False

    def _register(self) -> None:
        with self.ctx.sessions()() as session:
            workers.register(session, worker=self.worker, name=self.name, queues=consumed_queues(self.app),
                             tasks=task_versions(self.app), now_ms=self.ctx.clock.now_ms(), tables=self.ctx.tables)
            # rows of workers killed long ago (a warm shutdown deletes its own): kept small by each start
            workers.prune(session, self.ctx.clock.now_ms(), heartbeat_ms=self.ctx.settings.worker_heartbeat_ms,
                          tables=self.ctx.tables)
        self._registered = True

    def beat(self) -> None:
        """One heartbeat: refresh the row (register again when it is gone, or was never written)."""
        try:
            if self._registered:
                with self.ctx.sessions()() as session:
                    self._registered = workers.heartbeat(session, worker=self.worker, now_ms=self.ctx.clock.now_ms(),
                                                         tables=self.ctx.tables)
            if not self._registered:
                self._register()
        except Exception as e:
            log.warning("worker registry: could not refresh %s %s (the relay stops holding tasks for it after 3 "
                        "missed heartbeats): %s", self.name, self.worker, why(e, self.outbox))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="outbox-worker-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            with self.ctx.sessions()() as session:
                workers.unregister(session, worker=self.worker, tables=self.ctx.tables)
        except Exception as e:
            log.warning("worker registry: could not unregister %s (it expires after 3 heartbeats): %s",
                        self.worker, why(e, self.outbox))


def registry_step(outbox: Any) -> type[bootsteps.StartStopStep]:
    """A worker boot step that keeps the worker's registry row (after the pool started, before it stops)."""

    class OutboxWorkerRegistry(bootsteps.StartStopStep):
        requires = ("celery.worker.components:Pool",)  # type: ignore[assignment]

        def include_if(self, parent: Any) -> bool:
            return bool(outbox.settings.worker_heartbeat_ms)

        def create(self, parent: Any) -> Heartbeat:
            return Heartbeat(outbox, hostname=str(parent.hostname))

    return OutboxWorkerRegistry
