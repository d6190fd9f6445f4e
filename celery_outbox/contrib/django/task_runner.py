"""The Celery task that runs Django Tasks (``django.tasks``, Django 6) on the outbox's workers.

``OutboxTaskBackend.enqueue`` (``task_backend.py``) sends ``RUNNER`` with ``[task.module_path, args, kwargs]``:
inside ``atomic()`` that send is an outbox row of the transaction (``enqueue.py``), published by the relay
after the commit. On a worker, each run is one delivery of the Django consumer machinery
(``DjangoConsumerSpec``, ``celery_outbox.delivery``), as for ``@outbox.task``:

* the inbox row ``(task id, "task:django_tasks.run")`` and the Task function's Django ORM writes
  commit in ONE ``transaction.atomic()`` on the outbox's alias; a second run of the same task id (a broker
  redelivery, a relay duplicate, a worker killed after the commit) finds the row and does nothing;
* a raise rolls both back and becomes a Celery retry with backoff (the consumer settings' policy), the
  deliveries counted in the database; after ``max_retries + 1`` the call is a consumer dead letter that
  ``outbox dead-letters replay``, ``manage.py outbox`` and the admin re-send with the same task id.

Defined on every ``DjangoOutbox`` app (one name per app); this module imports ``django.tasks`` only when a
Task runs, so it loads on Django 5.2 too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from celery_outbox.celery.config import consumer_time_limits
from celery_outbox.celery.consumer_tasks import context_source, deliver_or_retry, finish
from celery_outbox.celery.idempotent_task import envelope_for
from celery_outbox.contrib.django.consumer import DjangoConsumerSpec
from celery_outbox.delivery import parse_body
from celery_outbox.errors import ConfigError
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.inbox.task_keys import task_key
from celery_outbox.messages import Envelope
from celery_outbox.policy import RetryPolicy
from celery_outbox.runtime import Context


class RunnerHost(Context, Protocol):
    """What the runner needs of its ``DjangoOutbox`` (a protocol: that module imports this one)."""

    @property
    def app(self) -> Any: ...
    @property
    def using(self) -> str: ...

RUNNER = "django_tasks.run"  # not under celery_outbox.: the capture leaves the library's own tasks alone
"""The Celery task name of every Django Task run (its args: the Task's module path, args, kwargs)."""


def call_task(module_path: str, args: list[Any], kwargs: dict[str, Any], *, task_id: str, backend: str | None,
              attempt: int, worker: str) -> Any:
    """Import the ``django.tasks.Task`` at ``module_path`` and call it (with a ``TaskContext`` when it takes one);
    its return value as JSON."""
    from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus
    from django.utils import timezone
    from django.utils.json import normalize_json
    from django.utils.module_loading import import_string

    try:
        task = import_string(module_path)
    except ImportError as e:
        raise ConfigError(f"Django task {module_path!r} cannot be imported on this worker: {e}") from None
    if not isinstance(task, Task):
        raise ConfigError(f"{module_path!r} is not a django.tasks Task (decorate it with @task)")
    if not task.takes_context:
        return normalize_json(task.call(*args, **kwargs))
    now = timezone.now()
    result = TaskResult(task=task, id=task_id, status=TaskResultStatus.RUNNING, enqueued_at=None, started_at=now,
                        finished_at=None, last_attempted_at=now, args=args, kwargs=kwargs,
                        backend=backend or task.backend, errors=[], worker_ids=[worker] * attempt)
    return normalize_json(task.call(TaskContext(task_result=result), *args, **kwargs))


def define(outbox: RunnerHost) -> Any:
    """Register ``RUNNER`` on ``outbox.app``; the task."""
    app = outbox.app
    if RUNNER in app._tasks:
        return app._tasks[RUNNER]
    settings = outbox.settings
    policy = RetryPolicy()
    backoff = policy.resolve(settings)
    max_depth = settings.max_json_depth
    soft_limit, hard_limit = consumer_time_limits(settings)
    key = task_key(RUNNER)

    def _not_called(_effect_envelope: Envelope) -> None:  # pragma: no cover - replaced per run
        raise AssertionError("the per-run effect replaces this one")

    base_spec = DjangoConsumerSpec(name=key, events=frozenset({RUNNER}), handler=lambda _s, _e: None, policy=policy,
                                   effect=_not_called, using=outbox.using)
    context = context_source(outbox, base_spec, policy=backoff)

    def run(self: Any, module_path: str, args: list[Any], kwargs: dict[str, Any], backend: str | None = None) -> Any:
        request_id = self.request.id
        if not isinstance(request_id, str) or not request_id:
            raise ConfigError(f"{RUNNER} was called without a task id: enqueue Django tasks with task.enqueue()")
        envelope = envelope_for(RUNNER, request_id, [module_path, args, kwargs, backend], {})
        returned: list[Any] = []

        def effect(_envelope: Envelope) -> None:
            returned.append(call_task(module_path, args, kwargs, task_id=request_id, backend=backend,
                                      attempt=self.request.retries + 1, worker=str(self.request.hostname or "")))

        parsed = parse_body(envelope, max_depth=max_depth)
        result = deliver_or_retry(self, outbox.sessions, replace(context(), spec=replace(base_spec, effect=effect)),
                                  parsed, request_id=envelope["message_id"])
        if result.outcome is Outcome.PROCESSED:
            return returned[0] if returned else None
        return finish(self, app, key, parsed, result)

    return app.task(
        name=RUNNER, bind=True, acks_late=True, reject_on_worker_lost=True, acks_on_timeout=False, max_retries=None,
        time_limit=hard_limit, soft_time_limit=soft_limit, shared=False, lazy=False,
        outbox_task_key=key, outbox_policy=policy,
    )(run)
