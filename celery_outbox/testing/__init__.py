"""Helpers for your own tests: run the relay, your consumers and your tasks synchronously, no broker, no worker.

    from celery_outbox.testing import run_pending
    outcomes = run_pending(outbox)          # relay -> in-memory broker -> each consumer and task, once
    assert outcomes["notify"] == [Outcome.PROCESSED]

Tasks sent with ``.delay()`` through the outbox: ``enqueued_tasks(outbox)`` lists them as the relay
would publish them, ``run_enqueued_tasks(outbox)`` runs them eagerly (``celery_outbox.testing.tasks``,
the twin of ``celery_outbox.contrib.django.testing``). ``InMemoryPublisher`` records what was published
(``messages()``) and can be scripted to fail (broker down, a message rejected, a crash after
publishing) to test your own failure handling; ``ManualClock`` moves time by hand. The pytest fixtures
(``celery_outbox.testing.pytest_plugin``) load by themselves once the package is installed.
"""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from celery_outbox.clock import ManualClock
from celery_outbox.delivery import deliver
from celery_outbox.errors import ConfigError
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope, TaskMessage
from celery_outbox.outbox import Outbox
from celery_outbox.relay.dispatch import dispatch_with_settings
from celery_outbox.testing.memory import InMemoryPublisher, PublisherCrashed
from celery_outbox.testing.tasks import enqueued_tasks, run_enqueued_tasks, run_task_message

__all__ = ["InMemoryPublisher", "ManualClock", "PublisherCrashed", "deliver_message", "drain", "enqueued_tasks",
           "make_envelope", "run_enqueued_tasks", "run_pending", "run_task_message"]


def make_envelope(type: str, payload: Any, *, message_id: uuid.UUID | None = None,
                  headers: Mapping[str, Any] | None = None, created_at_ms: int = 0) -> Envelope:
    """An envelope as a consumer receives it (what the relay would have sent)."""
    return Envelope(message_id=message_id or uuid.uuid4(), type=type, payload=payload, headers=dict(headers or {}),
                    created_at_ms=created_at_ms)


def drain(outbox: Outbox, publisher: InMemoryPublisher | None = None, *, max_batches: int = 1000) -> InMemoryPublisher:
    """Publish every due outbox row to ``publisher`` (a new in-memory one by default), marking them published."""
    publisher = publisher if publisher is not None else InMemoryPublisher()
    routes = outbox.routes()
    for _ in range(max_batches):
        with outbox.sessions()() as session:
            result = dispatch_with_settings(session, publisher, outbox.clock, outbox.settings, tables=outbox.tables,
                                            routes=routes)
        if result.drained:
            break
    return publisher


def deliver_message(outbox: Outbox, message: TaskMessage, *, redelivered: bool = False) -> Outcome:
    """Run the consumer task's work for one published message, in this process (no Celery worker)."""
    spec = outbox.registry[message.consumer]
    body = json.loads(message.body)[0][0]
    result = deliver(outbox.sessions(), spec, body, tables=outbox.tables, request_id=str(message.headers["id"]),
                     settings=outbox.settings, clock=outbox.clock, crash_points=outbox.crash_points,
                     first_delivery=not redelivered, redelivered=redelivered)
    return result.outcome


def run_pending(outbox: Outbox, publisher: InMemoryPublisher | None = None) -> dict[str, list[Outcome]]:
    """Drain the outbox once (into ``publisher``, a new in-memory one by default) and run what it published,
    in order: each event delivered to its consumer declared on ``outbox``, each task enqueued with
    ``.delay()`` run eagerly as a worker would (``run_task_message``). Outcomes by consumer name, and by
    task name (``Outcome.PROCESSED`` when the task succeeded); a task that failed raises its error once
    every published message ran, so a drained row is never left marked and not run.

    Messages for consumers that live in other services (``outbox.route``) are published but not run;
    what the run itself writes (a consumer's event, a task's task) waits for the next call.
    """
    publisher = publisher if publisher is not None else InMemoryPublisher()
    before = len(publisher.messages())
    messages = drain(outbox, publisher).messages()[before:]
    outcomes: dict[str, list[Outcome]] = defaultdict(list)
    failure: BaseException | None = None
    for message in messages:
        if message.exchange is not None:  # a task row (messages.task_row_message)
            result = run_task_message(outbox, message, throw=False)
            if result.successful():
                outcomes[message.consumer].append(Outcome.PROCESSED)
            elif failure is None:
                failure = result.result if isinstance(result.result, BaseException) else ConfigError(
                    f"task {message.consumer!r} ({message.message_id}) did not succeed: {result.state}")
        elif message.consumer in outbox.registry:
            outcomes[message.consumer].append(deliver_message(outbox, message))
    if failure is not None:
        raise failure
    return dict(outcomes)
