"""Custom Celery events, so duplicates absorbed and dead letters show in Flower and any event receiver.

Who sends them, under which name: a consumer task sends from inside the task, under the worker's own
node name (``task.request.hostname``, e.g. ``consumers@host``) and with the task's id as ``uuid``, so
Flower counts them on that worker (its worker counters skip any other name) and a receiver can tie
each one to its task entry. The beat drain task does the same for outbox rows it dead-letters; the
standalone relay (``outbox relay``, no worker) sends under ``outbox-relay@<host>``
(``relay_hostname``), and so is each message a reconcile pass published again (``outbox-reconciled``,
from the beat task's worker or the standalone relay). Sending is best-effort: an event that cannot be
sent is logged and dropped, it never fails the task that sent it, and it is never retried (the delivery's outcome is already
committed; an event is a notice, not a record). Events travel on the broker's event exchange
(``celeryev``), JSON like everything else.

The worker's own task events (``task-received``/``-started``/``-succeeded``..., what Flower shows) are
sent by the worker's parent process, one thread serving every pool process; on RabbitMQ with
``confirm_publish`` (the recommended configuration, for the relay's publishes) each of them would wait
for its publisher confirm. ``UnconfirmedTaskEvents`` gives the worker's event dispatcher a connection
of its own without confirms: the same events, no wait (docs/scaling.md).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from celery import Celery, bootsteps
from kombu import Producer

from celery_outbox.config.masking import mask_secrets

log = logging.getLogger(__name__)

DUPLICATE_ABSORBED = "outbox-duplicate-absorbed"
DEAD_LETTERED = "outbox-dead-lettered"
RECONCILED = "outbox-reconciled"  # the reconciler published a lost message again (relay/reconcile.py)
EVENT_TYPES = (DUPLICATE_ABSORBED, DEAD_LETTERED, RECONCILED)


def relay_hostname() -> str:
    """The node name the standalone relay's events carry."""
    return f"outbox-relay@{socket.gethostname()}"


def send_event(app: Celery, type: str, *, hostname: str | None = None, task_id: str | None = None,
               **fields: Any) -> bool:
    """Send one custom event; True if it was handed to the broker. Only our own types are allowed.

    ``hostname`` is the sender's node name (Celery's ``gen<pid>@host`` when None); ``task_id``
    travels as the event's ``uuid`` (the task the event is about)."""
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown outbox event type {type!r}; use one of {', '.join(EVENT_TYPES)}")
    if task_id is not None:
        fields["uuid"] = task_id
    try:
        with app.events.default_dispatcher(hostname=hostname) as dispatcher:
            dispatcher.send(type, retry=False, **fields)
    except Exception as e:
        log.warning("could not send Celery event %s (%s: %s); continuing", type, e.__class__.__name__,
                    mask_secrets(str(e)))
        return False
    return True


def task_sender(task: Any) -> dict[str, Any]:
    """``hostname`` and ``task_id`` for an event sent from inside ``task`` (its current request)."""
    request = task.request
    hostname = request.hostname if isinstance(request.hostname, str) and request.hostname else None
    task_id = request.id if isinstance(request.id, str) else None
    return {"hostname": hostname, "task_id": task_id}


def duplicate_absorbed(app: Celery, *, consumer: str, message_id: str, event_type: str | None = None,
                       hostname: str | None = None, task_id: str | None = None) -> bool:
    return send_event(app, DUPLICATE_ABSORBED, hostname=hostname, task_id=task_id, consumer=consumer,
                      message_id=message_id, event_type=event_type)


def dead_lettered(app: Celery, *, source: str, message_id: str, error: str, consumer: str | None = None,
                  event_type: str | None = None, attempts: int | None = None, hostname: str | None = None,
                  task_id: str | None = None, dead_letter: str | None = None, group: str | None = None) -> bool:
    """``dead_letter``/``group``: the consumer dead letter written (``consumer:<id>``) and its group, when known.
    ``error`` is masked before it is cut (Flower shows it; a relay's broker error may quote a URL)."""
    return send_event(app, DEAD_LETTERED, hostname=hostname, task_id=task_id, source=source, consumer=consumer,
                      message_id=message_id, error=mask_secrets(error)[:500], event_type=event_type, attempts=attempts,
                      dead_letter=dead_letter, group=group)


def reconciled(app: Celery, *, kind: str, message_id: str, target: str, hostname: str | None = None,
               task_id: str | None = None) -> bool:
    """A message the reconciler sent again: ``kind`` event / task / plain_task, ``target`` its consumer or task."""
    return send_event(app, RECONCILED, hostname=hostname, task_id=task_id, kind=kind, message_id=message_id,
                      target=target)


def without_confirms(consumer: Any) -> bool:
    """Move the worker consumer's event dispatcher to a broker connection without publisher confirms.

    Only when its connection asks for confirms (RabbitMQ with ``confirm_publish``); True when moved.
    Everything that holds the dispatcher (the task strategies, the heart) keeps it: only its
    connection and producer change. Any failure keeps the dispatcher as it was (confirmed events)."""
    dispatcher = getattr(consumer, "event_dispatcher", None)
    connection = getattr(dispatcher, "connection", None)
    if dispatcher is None or connection is None or not dispatcher.enabled:
        return False
    if not (getattr(connection, "transport_options", None) or {}).get("confirm_publish"):
        return False
    try:
        fresh = consumer.ensure_connected(consumer.app.connection_for_write(
            heartbeat=getattr(consumer, "amqheartbeat", None), transport_options={"confirm_publish": False}))
        producer = Producer(fresh, exchange=dispatcher.exchange, serializer=dispatcher.serializer, auto_declare=False)
    except Exception as e:
        log.warning("task events keep waiting for publisher confirms (no second connection: %s: %s)",
                    e.__class__.__name__, e)
        return False
    with dispatcher.mutex:
        dispatcher.connection, dispatcher.producer = fresh, producer
    try:
        connection.close()
    except Exception:  # already gone: nothing of ours was on it
        log.debug("closing the confirmed event connection failed", exc_info=True)
    return True


class UnconfirmedTaskEvents(bootsteps.StartStopStep):
    """Worker consumer step: task events without publisher confirms (module docstring).

    Runs after Celery's ``Events`` step, on every (re)start of the consumer; Celery's step closes the
    dispatcher's connection (now ours) when it stops."""

    requires = ("celery.worker.consumer.events:Events",)  # type: ignore[assignment]

    def start(self, parent: Any) -> None:
        without_confirms(parent)
