"""Replays go back to a consumer's queue as ordinary task messages, sent through the outbox's own Celery app."""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery

from celery_outbox.errors import BrokerUnavailableError, PublishError
from celery_outbox.inbox.dead_letters import Send, check_consumer
from celery_outbox.messages import task_id, task_name
from celery_outbox.runtime import Context


def replay_sender(app: Celery, ctx: Context) -> Send:
    """A ``send`` for ``replay`` that enqueues on the consumer's queue through ``app``.

    The task id is derived from (message_id, consumer) like the relay's, so Flower shows one task.
    """
    settings = ctx.settings
    consumers = ctx.known_consumers()

    def send(consumer: str, envelope: dict[str, Any]) -> None:
        check_consumer(consumer, consumers)
        try:
            tid: str | None = task_id(uuid.UUID(str(envelope.get("message_id"))), consumer)
        except ValueError:
            tid = None
        try:
            app.send_task(task_name(consumer), args=[envelope], queue=settings.queue_name(consumer), task_id=tid)
        except OSError as e:
            raise BrokerUnavailableError(f"cannot reach the broker to replay to {consumer}: {e}") from e
        except Exception as e:
            if e.__class__.__module__.split(".")[0] in ("kombu", "amqp", "redis", "celery"):
                raise PublishError(f"replay to {consumer} failed: {e.__class__.__name__}: {e}") from e
            raise

    return send
