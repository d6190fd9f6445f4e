"""A Django Tasks backend (``django.tasks``, Django 6) whose ``enqueue()`` is an outbox row of the open ``atomic()``.

    # settings.py
    TASKS = {"default": {"BACKEND": "celery_outbox.contrib.django.task_backend.OutboxTaskBackend"}}

    # orders/tasks.py
    from django.tasks import task

    @task
    def send_confirmation(order_id): Confirmation.objects.create(order_id=order_id)

    # the view
    with transaction.atomic():
        order = Order.objects.create(...)
        send_confirmation.enqueue(order.id)    # a row of THIS transaction: sent after the commit, never if it rolls back

Django's docs tell users to wrap ``enqueue`` in ``transaction.on_commit`` because a backend's queue is not the
database; here it is. The enqueue sends the Celery task ``task_runner.RUNNER`` through the project's
``DjangoOutbox`` app, so everything ``.delay()`` gets applies: inside ``atomic()`` on the outbox's alias the
message is an outbox row of that transaction; outside it, ``OUTBOX_ENQUEUE_OUTSIDE_TRANSACTION`` decides
(``own_transaction``: a row committed at once; ``raise``: refused). The relay publishes it; a Celery worker
runs the Task with the inbox (effect and inbox row in one ``atomic()``), retries and dead letters of
``@outbox.task`` (``task_runner.py``).

``OPTIONS``: ``{"OUTBOX": "proj.celery:outbox"}`` names the ``Outbox``; by default it is the one
``DjangoOutbox(app)`` registered (else ``OUTBOX_INSTANCE``). ``run_after`` is supported (the row waits in the
database until due); ``priority`` and async Tasks are not; ``get_result`` is not (Celery's result backend
holds the return value under the ``TaskResult.id`` if the project configures one). A ``queue_name`` other
than ``"default"`` is the Celery queue of that name (a worker must consume it: ``-Q``). Requires Django 6.
"""

from __future__ import annotations

from celery_outbox.errors import missing_extra

try:
    import django.tasks  # noqa: F401  (Django 6: one line saying so on 5.2)
except ModuleNotFoundError as e:
    raise missing_extra(e.name, needed_by="celery_outbox.contrib.django.task_backend", install='"Django>=6,<7"') from None

import uuid
from typing import Any

from django.tasks import DEFAULT_TASK_QUEUE_NAME, Task, TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.signals import task_enqueued
from django.utils import timezone

from celery_outbox.contrib.django import task_runner


class OutboxTaskBackend(BaseTaskBackend):  # type: ignore[misc]
    """``django.tasks`` backend: ``enqueue`` writes an outbox row in the current ``atomic()``; Celery runs it."""

    supports_defer = True
    supports_async_task = False
    supports_get_result = False
    supports_priority = False

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.outbox_spec: str | None = self.options.get("OUTBOX")

    def outbox(self) -> Any:
        """The ``DjangoOutbox`` this backend enqueues through (resolved at each enqueue: tests swap it)."""
        from celery_outbox.contrib.django import dead_letters
        from celery_outbox.contrib.django.outbox import project_outbox

        return dead_letters.load(self.outbox_spec) if self.outbox_spec else project_outbox()

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """The Celery send of ``task``'s run: an outbox row of the open ``atomic()`` (module docstring)."""
        self.validate_task(task)
        outbox = self.outbox()
        task_id = str(uuid.uuid4())
        options: dict[str, Any] = {"task_id": task_id}
        if task.run_after is not None:
            options["eta"] = task.run_after
        if task.queue_name != DEFAULT_TASK_QUEUE_NAME:
            options["queue"] = task.queue_name
        runner = task_runner.define(outbox)
        runner.apply_async(args=[task.module_path, list(args), dict(kwargs), self.alias], **options)
        result = TaskResult(task=task, id=task_id, status=TaskResultStatus.READY, enqueued_at=timezone.now(),
                            started_at=None, finished_at=None, last_attempted_at=None, args=list(args),
                            kwargs=dict(kwargs), backend=self.alias, errors=[], worker_ids=[])
        task_enqueued.send(type(self), task_result=result)
        return result
