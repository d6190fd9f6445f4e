"""Replays go back to a consumer's queue as ordinary task messages, sent through the outbox's own Celery app."""

from __future__ import annotations

from typing import Any

from celery import Celery

from celery_outbox.errors import BrokerUnavailableError, PublishError
from celery_outbox.inbox.dead_letters import Send, check_consumer
from celery_outbox.messages import task_id, task_name
from celery_outbox.runtime import Context


def replay_sender(app: Celery, ctx: Context) -> Send:
    """A ``send`` for ``replay`` that enqueues on the consumer's queue through ``app``.

    Every replay is a new task (``messages.task_id``): Flower keeps the dead-lettered delivery's
    FAILURE entry and shows the replay next to it; the inbox absorbs a replay that was already applied.
    """
    settings = ctx.settings
    consumers = ctx.known_consumers()

    def send(consumer: str, envelope: dict[str, Any]) -> None:
        check_consumer(consumer, consumers)
        try:
            app.send_task(task_name(consumer), args=[envelope], queue=settings.queue_name(consumer),
                          task_id=task_id())
        except OSError as e:
            raise BrokerUnavailableError(f"cannot reach the broker to replay to {consumer}: {e}") from e
        except Exception as e:
            if e.__class__.__module__.split(".")[0] in ("kombu", "amqp", "redis", "celery"):
                raise PublishError(f"replay to {consumer} failed: {e.__class__.__name__}: {e}") from e
            raise

    return send
