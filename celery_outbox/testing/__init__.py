"""Helpers for your own tests: run the relay and your consumers synchronously, no broker, no worker.

    from celery_outbox.testing import run_pending
    outcomes = run_pending(outbox)          # relay -> in-memory broker -> each consumer, once
    assert outcomes["notify"] == [Outcome.PROCESSED]

``InMemoryPublisher`` can also be scripted to fail (broker down, a message rejected, a crash after
publishing) to test your own failure handling; ``ManualClock`` moves time by hand. Add
``pytest_plugins = ["celery_outbox.testing.pytest_plugin"]`` to a conftest for fixtures.
"""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from celery_outbox.clock import ManualClock
from celery_outbox.delivery import deliver
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope, TaskMessage
from celery_outbox.outbox import Outbox
from celery_outbox.relay.dispatch import dispatch_with_settings
from celery_outbox.testing.memory import InMemoryPublisher, PublisherCrashed

__all__ = ["InMemoryPublisher", "ManualClock", "PublisherCrashed", "deliver_message", "drain", "make_envelope",
           "run_pending"]


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


def run_pending(outbox: Outbox) -> dict[str, list[Outcome]]:
    """Drain the outbox and deliver every message to its consumer declared on ``outbox``; outcomes by consumer.

    Messages for consumers that live in other services (``outbox.route``) are published but not run.
    """
    publisher = drain(outbox)
    outcomes: dict[str, list[Outcome]] = defaultdict(list)
    for message in publisher.published:
        if message.consumer in outbox.registry:
            outcomes[message.consumer].append(deliver_message(outbox, message))
    return dict(outcomes)
