"""Replays go back to a consumer's queue as ordinary task messages, sent through the outbox's own Celery app.

A dead letter of a task (an ``@outbox.task`` call, or a task message the worker's gate
dead-lettered, ``celery.gate``; its consumer column holds the task's key, ``inbox.task_keys``, never
a consumer name) goes back as the same task: same name, arguments and task id, routed as the app
routes that task, published straight to the broker (never into the outbox), so the inbox still
guards an ``@outbox.task``: a call that did commit after all is absorbed as a duplicate. A plain
task has no inbox: its dead letter is marked replayed, so it is re-sent once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery

from celery_outbox.celery.enqueue import publishing_directly
from celery_outbox.errors import BrokerUnavailableError, NotFoundError, PublishError, ValidationError
from celery_outbox.inbox.dead_letters import check_consumer
from celery_outbox.inbox.task_keys import is_task_key, task_key
from celery_outbox.messages import task_id as new_task_id
from celery_outbox.messages import task_name
from celery_outbox.runtime import Context


class ReplaySender:
    """``send(consumer, envelope)`` for ``replay``, plus ``check_task`` to validate a task dead letter up front."""

    def __init__(self, app: Celery, ctx: Context) -> None:
        self.app = app
        self.settings = ctx.settings
        self.consumers = ctx.known_consumers()

    def __call__(self, consumer: str, envelope: dict[str, Any]) -> None:
        self.send_as(consumer, envelope, task_id=None)

    def send_as(self, consumer: str, envelope: dict[str, Any], *, task_id: str | None) -> None:
        """Send the replay; a consumer's under ``task_id`` (the dead-lettered delivery's), or a new task id
        when None. A task's always goes under the task id its stored call names (its inbox key)."""
        if is_task_key(consumer):
            task, tid, args, kwargs = self.check_task(consumer, envelope)
            with _publish_errors(f"task {task.name}"), publishing_directly(self.app):  # never into the outbox
                task.apply_async(args=args, kwargs=kwargs, task_id=tid)
            return
        check_consumer(consumer, self.consumers)
        with _publish_errors(consumer):
            self.app.send_task(task_name(consumer), args=[envelope], queue=self.settings.queue_name(consumer),
                               task_id=task_id or new_task_id())

    def check_task(self, consumer: str, envelope: dict[str, Any]) -> tuple[Any, str, list[Any], dict[str, Any]]:
        """The idempotent task a task dead letter re-runs, with its task id, args and kwargs.

        ``ValidationError`` when the stored body is not a task call; ``NotFoundError`` when this app
        defines no idempotent task of that name under that key (import the module defining it)."""
        from celery_outbox.celery.idempotent_task import task_call

        call = task_call(envelope)
        if call is None:
            raise ValidationError(f"the dead letter of {consumer!r} is not a stored task call, so it cannot be "
                                  "replayed as a task; inspect its body and purge it")
        name, tid, args, kwargs = call
        task = self.app.tasks.get(name)
        # An idempotent task's own key, or (a plain task's message the worker's gate dead-lettered) its name's key.
        if task is None or getattr(task, "outbox_task_key", task_key(name)) != consumer:
            raise NotFoundError(f"no task {name!r} (key {consumer!r}) is defined on this app; import the module "
                                "that declares it (@outbox.task or @app.task) before replaying")
        return task, tid, args, kwargs


def replay_sender(app: Celery, ctx: Context) -> ReplaySender:
    """A ``send`` for ``replay`` that enqueues on the consumer's queue through ``app``.

    A consumer replay runs under the task id of the delivery that was dead-lettered, when the dead
    letter kept it (``inbox.dead_letters.replay``): Flower's page for that task goes from FAILURE (the
    reason names the dead letter and its group) to the replay's outcome. A dead letter without one
    (written before the column existed) is replayed as a new task (``messages.task_id``). Either way
    the inbox, keyed by the envelope's message_id, absorbs a replay that was already applied. A task
    replay keeps its task id: the id is that task's inbox key.
    """
    return ReplaySender(app, ctx)


@contextmanager
def _publish_errors(target: str) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise BrokerUnavailableError(f"cannot reach the broker to replay to {target}: {e}") from e
    except Exception as e:
        if e.__class__.__module__.split(".")[0] in ("kombu", "amqp", "redis", "celery"):
            raise PublishError(f"replay to {target} failed: {e.__class__.__name__}: {e}") from e
        raise
