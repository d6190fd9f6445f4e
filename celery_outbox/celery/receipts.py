"""The worker side of task receipts (celery_outbox/inbox/receipts.py): which plain tasks reached a worker.

``Outbox`` adds ``receipt_step(outbox)`` to its app's worker boot steps, so every ``celery worker`` of
that app records receipts with no call of the user's; nothing is connected outside a worker. The
step connects three Celery signals, each for this app's tasks whose message carries
``RECEIPT_HEADER`` (a plain task captured into the outbox; an ``@outbox.task`` has its inbox row):

* ``task_prerun`` (the pool process, just before the task body): the receipt;
* ``task_received`` (the worker's main process), only for a message with an ``eta``: the worker holds
  it unacked until then, so it is recorded when received, not when it starts;
* ``task_revoked`` (revoked or expired): the worker deliberately did not run it; the reconciler must
  not resurrect it.

A receipt that cannot be written (the database is away) is logged and the task runs anyway: the
cost is that the reconciler sends the task once more after its window (docs/guarantees.md).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps, signals

from celery_outbox.db import is_disconnect
from celery_outbox.inbox import receipts
from celery_outbox.runtime import Context

log = logging.getLogger(__name__)


class Receipts:
    """Records receipts of ``outbox``'s plain outbox tasks (the signal handlers)."""

    def __init__(self, outbox: Any) -> None:
        self.outbox = outbox

    def wanted(self, task: Any, headers: Any) -> bool:
        """A task of this app, not an ``@outbox.task``, whose message asks for a receipt."""
        if task is None or getattr(task, "app", None) is not self.outbox.app:
            return False
        if getattr(task, "outbox_task_key", None):
            return False
        return receipts.wants_receipt({receipts.RECEIPT_HEADER: _get(headers, receipts.RECEIPT_HEADER)})

    def record(self, task_id: Any) -> bool:
        """Write the receipt of ``task_id``; False (logged) when it could not be written."""
        key = receipts.task_uuid(task_id)
        if key is None:
            return False
        ctx: Context = self.outbox
        try:
            try:
                with ctx.sessions()() as session:
                    receipts.record(session, key, now_ms=ctx.clock.now_ms(), tables=ctx.tables)
            except Exception as e:  # a pooled connection that died unpinged (db.pre_ping_after_idle): once more
                if not is_disconnect(e):
                    raise
                with ctx.sessions()() as session:
                    receipts.record(session, key, now_ms=ctx.clock.now_ms(), tables=ctx.tables)
        except Exception as e:
            log.warning("could not record the receipt of task %s (the reconciler may send it again after "
                        "OUTBOX_RELAY_RECONCILE_PLAIN_TASKS_AFTER_MS): %s: %s", key, type(e).__name__, e)
            return False
        return True

    # -- signal handlers ---------------------------------------------------------------------------
    def on_prerun(self, sender: Any = None, task_id: Any = None, task: Any = None, **kwargs: Any) -> None:
        request = getattr(task, "request", None)
        if self.wanted(task, request) and not _get(request, "eta"):
            self.record(task_id)

    def on_received(self, sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        if request is None or not getattr(request, "eta", None):
            return
        if self.wanted(getattr(request, "task", None), getattr(request, "request_dict", None)):
            self.record(getattr(request, "id", None))

    def on_revoked(self, sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        if self.wanted(sender, request):
            self.record(_get(request, "id"))

    def connect(self) -> None:
        uid = f"celery_outbox.receipts.{id(self.outbox)}"
        signals.task_prerun.connect(self.on_prerun, weak=False, dispatch_uid=f"{uid}.prerun")
        signals.task_received.connect(self.on_received, weak=False, dispatch_uid=f"{uid}.received")
        signals.task_revoked.connect(self.on_revoked, weak=False, dispatch_uid=f"{uid}.revoked")


def _get(obj: Any, name: str) -> Any:
    """``name`` of a Celery request: a mapping (the message headers) or an object (a task's request,
    whose message headers are its attributes in a worker, and its ``headers`` under ``.apply()``)."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:
        headers = getattr(obj, "headers", None)
        if isinstance(headers, dict):
            value = headers.get(name)
    return value


def receipt_step(outbox: Any) -> type[bootsteps.Step]:
    """A worker boot step that connects ``outbox``'s receipt handlers in the worker process (before
    the pool forks, so every pool process has them)."""

    class OutboxReceipts(bootsteps.Step):
        def __init__(self, parent: Any, **kwargs: Any) -> None:
            Receipts(outbox).connect()
            super().__init__(parent, **kwargs)  # type: ignore[no-untyped-call]

    return OutboxReceipts
