"""The Celery configuration the outbox relies on: JSON only, late acks, one durable queue per consumer."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from celery_outbox.config.declare import broker_kind
from celery_outbox.errors import MissingExtraError, missing_extra
from celery_outbox.settings import Settings

DRAIN_TASK = "celery_outbox.drain"
RECONCILE_TASK = "celery_outbox.reconcile"
PRUNE_TASK = "celery_outbox.prune"


def add_task_routes(app: Any, routes: Mapping[str, Mapping[str, str]]) -> None:
    """Route these tasks to their queues (``send_task``, retries), keeping routes others set."""
    existing = app.conf.task_routes
    if not existing:
        app.conf.task_routes = dict(routes)
    elif isinstance(existing, Mapping):
        app.conf.task_routes = {**existing, **routes}
    else:  # a sequence of routers: ours first
        app.conf.task_routes = (dict(routes), *tuple(existing))


QUORUM_MIN_DELIVERY_LIMIT = 20  # RabbitMQ 4's own default delivery limit for quorum queues


def quorum_delivery_limit(settings: Settings) -> int:
    """The ``x-delivery-limit`` of the library's quorum queues: twice the consumers' own limit, at least 20.

    A quorum queue counts every return of a message to the queue (a worker killed with the message
    unacked, a hard time limit, a connection or node lost) and drops it once it was returned more
    than this many times. The library counts the same returns in the database (a delivery arriving
    ``redelivered`` counts the lost one, ``delivery.deliver``) and dead-letters into its own store
    at ``consumer_max_deliveries``, so the store must come first: a Celery retry is a new message
    (the broker's count starts again at 0, ours goes on), so ours is never behind, except for a
    streak of returns of a message no worker started (node losses in a row), hence the margin. A
    message the broker does drop was published; the relay's reconciler re-sends it after
    ``relay_reconcile_after_ms`` and the persisted count dead-letters it then
    (docs/scaling.md, "Quorum queues and dead letters").
    """
    return max(QUORUM_MIN_DELIVERY_LIMIT, 2 * settings.consumer_max_deliveries)


def require_broker_client(broker_url: str) -> None:
    """A ``redis://`` or ``sentinel://`` broker needs the redis client (the ``[redis]`` extra): one line naming
    the extra before kombu opens a connection (it would raise its own ImportError, naming no extra)."""
    if broker_kind(broker_url) == "redis" and importlib.util.find_spec("redis") is None:
        scheme = broker_url.split("://", 1)[0]
        raise missing_extra("redis", needed_by=f"the {scheme}:// broker")


class BrokerClientCheck:
    """An ``import_modules`` receiver (sent with the app when a ``celery worker`` or ``celery beat`` of it loads
    its tasks, before either opens a broker connection): one whose broker needs a client that is not installed
    (``redis://`` without the ``[redis]`` extra) stops with one line naming the extra, exit 1, before kombu imports
    its transport and fails with a traceback naming none. A ``SystemExit``: Celery would show an exception's
    traceback."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __call__(self, sender: Any = None, **_kw: Any) -> None:
        app: Any = self.app
        if sender is not app:
            return
        try:
            require_broker_client(str(self.app.conf.broker_url or ""))
        except MissingExtraError as e:
            raise SystemExit(f"Error: bad configuration: {e}") from None


def queue_arguments(settings: Settings, broker_url: str) -> dict[str, Any]:
    """Declaration arguments of the library's queues: quorum ones on RabbitMQ when the settings ask.

    The same arguments must reach every declaration of a queue (the Celery app's ``task_queues``,
    ``Outbox``'s queues, the kombu publisher): RabbitMQ refuses a redeclaration with other
    arguments (``PRECONDITION_FAILED``), and an existing classic queue is not converted (docs/scaling.md
    says how to move one). Redis has no queue types: asking for quorum queues there is an error.
    """
    if settings.broker_queue_type != "quorum":
        return {}
    if broker_kind(broker_url) == "redis":  # sentinel:// included
        from celery_outbox.errors import ConfigError

        raise ConfigError("OUTBOX_BROKER_QUEUE_TYPE=quorum needs RabbitMQ (amqp://); Redis has no quorum queues")
    if broker_kind(broker_url) != "rabbitmq":
        return {}
    return {"x-queue-type": "quorum", "x-delivery-limit": quorum_delivery_limit(settings)}


def redis_transport_options(settings: Settings) -> dict[str, Any]:
    """Redelivery of unacked messages on Redis, sized from one setting.

    kombu keeps a message a worker took in an "unacked" set with the time it took it; every live
    worker scans that set and puts back what is older than ``visibility_timeout``. By default it
    scans every ``unacked_restore_interval`` (10 s) x ``unacked_restore_throttle`` (10) = 100 s,
    so a message of a worker killed whole came back up to 100 s after the timeout; the throttle is
    1 here and the interval a tenth of the timeout (1 to 30 s), so it comes back within
    ``visibility_timeout + interval``. The scan runs under a mutex kept in Redis; a worker killed
    while holding it would block every scan until it expires (300 s by default), so it expires after
    one interval too (two workers scanning at once cannot restore a message twice: each restore is a
    WATCH/MULTI transaction). Worst case: ``visibility_timeout + 2 x interval`` after the dead
    worker took the message (``tests/hostile/test_redis_redelivery.py``). Needs kombu >= 5.7, the
    first release that reads the interval and the throttle.
    """
    vt = settings.broker_visibility_timeout_s
    interval = max(1, min(30, vt // 10))  # seconds between two scans
    return {
        "visibility_timeout": vt,
        "unacked_restore_interval": interval,
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": interval,
    }


def is_sentinel_url(url: object) -> bool:
    """A kombu ``sentinel://`` broker URL (Redis behind Sentinel; ``;``-separated, one per sentinel)."""
    return isinstance(url, str) and url.split(";", 1)[0].strip().lower().startswith("sentinel://")


SENTINEL_OPTIONS = ("master_name", "sentinel_kwargs", "min_other_sentinels")  # kombu's, for sentinel://


def sentinel_options(settings: Settings, broker_url: str, app_options: Mapping[str, Any] | None = None
                     ) -> dict[str, Any]:
    """What a kombu connection to a ``sentinel://`` broker needs beyond its URL (``{}`` for any other broker).

    kombu finds the master through the sentinels by name and takes the name only from the transport
    options (``master_name``), never from the URL. Every connection the library opens (the Celery app,
    the relay's publisher, the readiness and queue probes) gets it from one place: the app's own
    ``broker_transport_options`` when they name it, else ``OUTBOX_BROKER_SENTINEL_MASTER``; neither is
    a ``ConfigError`` (one line at start-up, not a kombu ``ValueError`` at the first connection).
    """
    if not is_sentinel_url(broker_url):
        return {}
    found = {k: v for k, v in (app_options or {}).items() if k in SENTINEL_OPTIONS}
    if "master_name" not in found and settings.broker_sentinel_master:
        found["master_name"] = settings.broker_sentinel_master
    if not found.get("master_name"):
        from celery_outbox.errors import ConfigError

        raise ConfigError("a sentinel:// broker needs its master's name: set OUTBOX_BROKER_SENTINEL_MASTER or "
                          "broker_transport_options={'master_name': ...} on the Celery app")
    return found


def consumer_time_limits(settings: Settings) -> tuple[float, float]:
    """``(soft, hard)`` time limits of a consumer task, from ``consumer_time_limit_s`` (the hard one).

    A delivery that blocks for ever (a database that stopped answering without closing the
    connection, a handler stuck on a network call) must end. The soft limit raises
    ``SoftTimeLimitExceeded`` in the task, which the delivery records as a failure (counted, retried
    with backoff) when the handler is running Python code; a call blocked inside the database driver
    never sees it, so the hard limit kills the pool process. The consumer task sets
    ``acks_on_timeout=False`` (Celery >= 5.7), so the message of a hard kill is rejected with
    requeue, comes back marked redelivered, and ``delivery.deliver`` counts the lost delivery: a
    message that always hangs ends in the dead-letter store after the consumer's maximum deliveries.
    Not set app-wide (``task_acks_on_timeout``): your own tasks with a time limit keep Celery's
    default. Time limits need the prefork pool (``-P prefork``, the default); solo and threads
    ignore the hard limit.
    """
    hard = float(settings.consumer_time_limit_s)
    gap = min(30.0, max(1.0, hard / 10))
    soft = hard - gap if hard > 2 * gap else hard / 2
    return soft, hard


def beat_schedule(settings: Settings) -> dict[str, Any]:
    """The periodic relay work for ``celery beat``: drain every poll interval, reconcile, hourly retention.

    ``Outbox`` adds these to any app it is given (keys the app already has win); a lease row makes each
    run once per interval even beside a standalone relay (celery_outbox/relay/lease.py).
    """
    relay_queue = f"{settings.namespace}.relay"
    return {
        "drain-outbox": {
            "task": DRAIN_TASK,
            "schedule": settings.relay_poll_interval_s,
            "options": {"queue": relay_queue, "expires": max(settings.relay_poll_interval_s, 1.0)},
        },
        "reconcile-outbox": {  # relay/reconcile.py: re-send what a consumer never recorded
            "task": RECONCILE_TASK, "schedule": settings.relay_reconcile_interval_s,
            "options": {"queue": relay_queue, "expires": settings.relay_reconcile_interval_s},
        },
        "prune-retention": {  # celery_outbox.celery.ops_tasks: hourly, inbox kept >= broker_redelivery_window_ms
            "task": PRUNE_TASK, "schedule": 3600.0,
            "options": {"queue": relay_queue, "expires": 3600.0},
        },
    }


def celery_config(settings: Settings, broker_url: str, *, beat_schedule_filename: str | None = None,
                  consumers: tuple[str, ...] = ()) -> dict[str, Any]:
    """The Celery configuration for these settings. ``broker_url`` is already resolved (no 'embedded')."""
    from kombu import Exchange, Queue

    exchange = Exchange(settings.exchange_name, type="direct", durable=True)
    arguments = queue_arguments(settings, broker_url)
    queues = [
        Queue(settings.queue_name(c), exchange, routing_key=settings.queue_name(c), durable=True,
              queue_arguments=dict(arguments))
        for c in dict.fromkeys((*settings.consumers, *consumers))
    ]
    relay_queue = Queue(f"{settings.namespace}.relay", Exchange(f"{settings.namespace}.relay"),
                        routing_key=f"{settings.namespace}.relay", durable=True, queue_arguments=dict(arguments))
    return {
        "broker_url": broker_url,
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_ignore_result": True,
        "result_backend": None,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # One unacked message per pool process: a larger prefetch lets a busy process hold messages an
        # idle one could run (a longer latency tail) and hands back more on a worker crash.
        "worker_prefetch_multiplier": 1,
        # After a reconnect Celery lowers the prefetch count and raises it back as in-flight tasks
        # ack; acks of tasks delivered on the dead connection fail, and a worker was seen stuck,
        # consuming nothing, after a RabbitMQ outage (chaos run; celery/celery#9512). Prefetch is 1
        # per process here, so there is nothing to protect by reducing it.
        "worker_enable_prefetch_count_reduction": False,
        # No task events here (Celery's default, off): three per task cost the worker's parent and the
        # broker a publish each, and Flower turns them on in the workers it sees (docs/operations.md,
        # "Flower"); ``-E`` turns them on without Flower. An outbox worker sends them, when on, without
        # publisher confirms (celery/events.py, UnconfirmedTaskEvents).
        "task_queues": [*queues, relay_queue],
        "task_default_queue": relay_queue.name,
        "task_default_exchange": relay_queue.exchange.name,
        "task_default_routing_key": relay_queue.routing_key,
        "task_create_missing_queues": False,
        # Redis: no ``polling_interval`` (kombu 5.7 reads it as the BRPOP timeout; BRPOP returns as soon
        # as a message arrives, so it bounds nothing but idle wake-ups).
        "broker_transport_options": {"confirm_publish": True}
        if broker_kind(broker_url) == "rabbitmq"
        else {**redis_transport_options(settings), **sentinel_options(settings, broker_url)},
        "beat_schedule": beat_schedule(settings),
        **({"beat_schedule_filename": beat_schedule_filename} if beat_schedule_filename else {}),
        "worker_hijack_root_logger": False,
    }


# What ``recommended_celery_config`` sets on an app you already run: behaviour the guarantees rely on, never
# your queues, default queue, routes, result backend, transport options or beat schedule (``Outbox`` adds
# its own queues, routes, transport options and beat entries to those, keeping yours; README "Adopt it").
MERGED_KEYS = (
    "broker_connection_retry_on_startup",
    "task_serializer", "result_serializer", "event_serializer", "accept_content", "result_accept_content",
    "task_acks_late", "task_reject_on_worker_lost",
    "worker_prefetch_multiplier", "worker_enable_prefetch_count_reduction",
)


def recommended_celery_config(settings: Settings, broker_url: str | None = None, *, dedicated: bool = False,
                              beat_schedule_filename: str | None = None, consumers: tuple[str, ...] = ()
                              ) -> dict[str, Any]:
    """What we run Celery with, for ``app.conf.update(...)`` on the app your ``Outbox`` is built on.

    By default it merges into an app you already run: JSON only, late acks with ``reject_on_worker_lost``
    (a task of a killed worker is redelivered, yours too), prefetch 1 (``MERGED_KEYS``), and ``broker_url``
    when you pass one. Task events stay as you set them (Celery's default: off; Flower turns them on in the
    workers it sees). Your queues, default queue, routes and result backend stay; the ``Outbox`` adds its
    queues beside yours. ``dedicated=True`` is for an app that runs only the outbox (the reference
    deployment): every key of ``celery_config``, including the queue list, the relay's queue as the
    default, no result backend.
    """
    url = broker_url if broker_url is not None else (settings.broker_url or "")
    full = celery_config(settings, url, beat_schedule_filename=beat_schedule_filename, consumers=consumers)
    if dedicated:
        return full
    merged = {key: full[key] for key in MERGED_KEYS}
    if broker_url:
        merged["broker_url"] = broker_url
    return merged
