"""Retries with backoff on RabbitMQ quorum queues: waited out in the broker, never in a worker's prefetch slot.

A consumer's (or ``@outbox.task``'s) retry is a Celery ``retry(countdown=...)``: a new message with an
``eta``. On a classic queue the worker takes it at once and holds it unacked until due, raising its
prefetch count meanwhile. A quorum queue has no global QoS, so Celery turns it off and the prefetch
count stays where it was: a held retry fills one of the worker's slots until due, and a worker whose
slots all hold waiting retries takes nothing else (docs/scaling.md). Celery 5.5+ answers this with
"native delayed delivery": a chain of 28 quorum queues with per-level TTLs (``celery_delayed_0`` ...
``_27``, declared by Celery's ``DelayedDelivery`` worker step) that hands the message to the topic
exchange ``celery_delayed_delivery`` once the countdown has passed, whose bindings lead it back to its
queue. Celery reroutes a countdown through that chain only for a queue whose exchange is not ``direct``,
and binds only such exchanges; the library's exchanges are direct (the relay routes by queue name), so
Celery logs at every worker start that it cannot use them, and before this module every retry waited
in a worker.

So the library routes its own retries there itself, leaving its exchanges as they are:

* ``retry_options`` gives a retry on a quorum queue a destination whose exchange is
  ``celery_delayed_delivery`` (a topic exchange) and whose routing key is the queue's name: Celery then
  publishes it into the chain with the countdown in whole seconds (the chain's unit; rounded up, so a
  retry never comes early) and the message reaches the queue when due, unacked by nobody meanwhile;
* ``DelayedRetries``, a worker (consumer) step, declares the chain (idempotently, as Celery's step
  does) and binds each quorum queue the worker consumes to ``celery_delayed_delivery`` with
  ``#.<queue>``, the key the chain's messages carry; it also drops Celery's start-up warning about the
  library's own direct exchanges (``<namespace>.events``, ``<namespace>.relay``), whose retries no
  longer go through them. A message published straight to those exchanges with an ``eta`` (not the
  outbox's way: a task sent through the outbox with an eta further ahead than
  ``OUTBOX_ENQUEUE_HOLD_ETA_AFTER_MS`` waits as a row, docs/scheduled.md) is still held by the worker.

A retry that waits in the chain is in no consumer queue and held by no consumer; the reconciler counts
a message with a failed delivery on record from its last failure (relay/reconcile.py), and the longest
countdown (``OUTBOX_CONSUMER_RETRY_BACKOFF_MAX_S``) is below its floor. If the chain is missing (a broker
where the step could not declare it) the retry's publish fails and Celery fails the task; the message
was published by the relay, so the reconciler re-sends it (docs/guarantees.md).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from celery import bootsteps
from kombu import Exchange, Queue

from celery_outbox.config.declare import broker_kind

log = logging.getLogger(__name__)

# Celery's and kombu's names (kombu.transport.native_delayed_delivery, Celery 5.5+): Celery publishes a
# countdown to ``celery_delayed_27`` with the countdown's 28 bits before the routing key; the chain ends in
# the topic exchange below.
DELIVERY_EXCHANGE = "celery_delayed_delivery"
_DELAY_BITS = 28
_DELAY_PREFIX = re.compile(rf"^(?:[01]\.){{{_DELAY_BITS}}}")
_KOMBU_LOGGER = "kombu.transport.native_delayed_delivery"


def is_quorum(queue: Any) -> bool:
    """A kombu ``Queue`` declared as a RabbitMQ quorum queue."""
    arguments = getattr(queue, "queue_arguments", None) or {}
    return isinstance(arguments, Mapping) and arguments.get("x-queue-type") == "quorum"


def _uses_amqp(app: Any) -> bool:
    """The app's broker is RabbitMQ (the first of a failover list names the transport)."""
    url = app.conf.broker_write_url or app.conf.broker_url
    if isinstance(url, (list, tuple)):
        url = url[0] if url else None
    return broker_kind(url) == "rabbitmq"


def delivered_queue(app: Any, delivery_info: Mapping[str, Any] | None) -> Any:
    """The app's declared queue a message was delivered from, by its routing key (a retry that came through
    the delay chain carries the countdown's bits before it); ``None`` when the app declares none by that key."""
    key = str((delivery_info or {}).get("routing_key") or "")
    key = _DELAY_PREFIX.sub("", key, count=1)
    if not key:
        return None
    queues = app.amqp.queues
    found = queues.get(key)
    if found is not None and found.routing_key == key:
        return found
    return next((q for q in queues.values() if q.routing_key == key), None)


def retry_options(task: Any, countdown: float) -> tuple[float, dict[str, Any]]:
    """``(countdown, options)`` for ``task.retry``: on a quorum queue on RabbitMQ, the retry goes through
    the broker's delay chain (a whole number of seconds, at least 1 when there is any wait); otherwise
    unchanged, and Celery sends the retry back the way the message came."""
    request = task.request
    if getattr(request, "is_eager", False):
        return countdown, {}
    return queue_retry_options(task.app, delivered_queue(task.app, getattr(request, "delivery_info", None)),
                               countdown)


def queue_retry_options(app: Any, queue: Any, countdown: float) -> tuple[float, dict[str, Any]]:
    """``retry_options`` for a message of ``queue`` (one of the app's declared queues, or ``None``), for a
    retry sent with ``apply_async`` (a batch consumer's)."""
    if queue is None or not is_quorum(queue) or not _uses_amqp(app):
        return countdown, {}
    target = Queue(queue.name, Exchange(DELIVERY_EXCHANGE, type="topic", durable=True), routing_key=queue.routing_key,
                   durable=True, queue_arguments=dict(queue.queue_arguments or {}))
    whole = float(math.ceil(countdown)) if countdown > 0 else 0.0
    return whole, {"queue": target}


class _OwnDirectExchanges(logging.Filter):
    """Drops kombu's "Exchange X is a direct exchange and native delayed delivery do not support direct
    exchanges" for the library's own exchanges (their retries take the delay chain through ``retry_options``)."""

    def __init__(self, names: Iterable[str]) -> None:
        super().__init__()
        self.prefixes = tuple(f"Exchange {name} is a direct exchange" for name in names)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot format is not the one we drop
            return True
        return not message.startswith(self.prefixes)


def quiet_own_exchanges(names: Iterable[str]) -> None:
    """Install (once per set of names) the filter above on kombu's native-delayed-delivery logger."""
    logger = logging.getLogger(_KOMBU_LOGGER)
    wanted = _OwnDirectExchanges(names)
    if any(isinstance(f, _OwnDirectExchanges) and f.prefixes == wanted.prefixes for f in logger.filters):
        return
    logger.addFilter(wanted)


def bind_quorum_queues(connection: Any, queues: Iterable[Any], *, queue_type: str) -> list[str]:
    """Declare the delay chain on ``connection`` and bind each of ``queues`` to its end with ``#.<routing
    key>``; returns the names bound."""
    from kombu.transport.native_delayed_delivery import declare_native_delayed_delivery_exchanges_and_queues

    declare_native_delayed_delivery_exchanges_and_queues(connection, queue_type)
    channel = connection.channel()
    bound: list[str] = []
    try:
        for queue in queues:
            queue.bind(channel).bind_to(exchange=DELIVERY_EXCHANGE, routing_key=f"#.{queue.routing_key}")
            bound.append(str(queue.name))
    finally:
        channel.close()
    return bound


def consumed_quorum_queues(app: Any) -> list[Any]:
    """The quorum queues a worker of ``app`` consumes (``-Q``, else every queue the app declares)."""
    queues = app.amqp.queues
    names = queues.consume_from if queues.consume_from else queues
    return [queues[name] for name in names if is_quorum(queues[name])]


class DelayedRetries(bootsteps.StartStopStep):
    """Worker (consumer) step: the delay chain declared and this worker's quorum queues bound to its end.

    Runs after the task consumer has declared the queues. A failure is logged, never fatal: the worker
    consumes as before, and a retry it cannot route fails its task, which the reconciler repairs.
    """

    requires = ("celery.worker.consumer.tasks:Tasks",)  # type: ignore[assignment]  # Celery types it as ()
    names: tuple[str, ...] = ()  # the library's direct exchanges, set by ``delayed_retries_step``

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        if self.names:
            quiet_own_exchanges(self.names)
        super().__init__(parent, **kwargs)  # type: ignore[no-untyped-call]

    def include_if(self, parent: Any) -> bool:
        return bool(consumed_quorum_queues(parent.app)) and _uses_amqp(parent.app)

    def start(self, parent: Any) -> None:
        app = parent.app
        queues = consumed_quorum_queues(app)
        try:
            with app.connection_for_write() as connection:
                connection.ensure_connection(max_retries=3)
                bound = bind_quorum_queues(connection, queues,
                                           queue_type=str(app.conf.broker_native_delayed_delivery_queue_type))
        except Exception as e:  # logged; the worker still consumes
            log.warning("outbox: could not bind the quorum queues to the delay chain (%s: %s); a retry with a "
                        "countdown fails until a worker restarts", e.__class__.__name__, e)
            return
        log.info("outbox: retries wait in the broker's delay chain for %s", ", ".join(bound))


def delayed_retries_step(exchange_names: Iterable[str]) -> type[DelayedRetries]:
    """``DelayedRetries`` quieting Celery's warning for these (the library's own) direct exchanges."""
    return type("DelayedRetries", (DelayedRetries,), {"names": tuple(exchange_names)})
