"""Custom Celery events, so duplicates absorbed and dead letters show in Flower and any event receiver.

The relay and consumers call ``send_event`` (or the two helpers) with their Celery app. Sending is
best-effort: an event that cannot be sent is logged and dropped, it never fails the task that sent it.
Events travel on the broker's event exchange (``celeryev``), JSON like everything else.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

log = logging.getLogger(__name__)

DUPLICATE_ABSORBED = "outbox-duplicate-absorbed"
DEAD_LETTERED = "outbox-dead-lettered"
EVENT_TYPES = (DUPLICATE_ABSORBED, DEAD_LETTERED)


def send_event(app: Celery, type: str, **fields: Any) -> bool:
    """Send one custom event; True if it was handed to the broker. Only our own types are allowed."""
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown outbox event type {type!r}; use one of {', '.join(EVENT_TYPES)}")
    try:
        with app.events.default_dispatcher() as dispatcher:
            dispatcher.send(type, **fields)
    except Exception as e:
        log.warning("could not send Celery event %s (%s: %s); continuing", type, e.__class__.__name__, e)
        return False
    return True


def duplicate_absorbed(app: Celery, *, consumer: str, message_id: str, event_type: str | None = None) -> bool:
    return send_event(app, DUPLICATE_ABSORBED, consumer=consumer, message_id=message_id, event_type=event_type)


def dead_lettered(app: Celery, *, source: str, message_id: str, error: str, consumer: str | None = None,
                  event_type: str | None = None, attempts: int | None = None) -> bool:
    return send_event(app, DEAD_LETTERED, source=source, consumer=consumer, message_id=message_id,
                      error=error[:500], event_type=event_type, attempts=attempts)
