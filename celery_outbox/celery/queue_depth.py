"""The broker half of the queue metrics: messages waiting in each consumer's queue and, on RabbitMQ, the
consumers attached to it (``celery_outbox.ops.metrics`` takes the callable ``queue_probe`` returns, so the
core never imports kombu).

One connection per scrape, one passive declare per consumer queue (it creates nothing): RabbitMQ answers
with the ready-message and consumer counts; Redis (kombu's virtual transport) with the list's length and
no consumer count, since nothing in Redis records who waits on a list. A queue not declared yet holds no
message. Bounded by ``timeout_s`` like the readiness probe, so a broker that is down costs a scrape at
most that long and reports ``outbox_queue_probe_up 0``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery_outbox.celery.config import sentinel_options
from celery_outbox.celery.probe import DEFAULT_TIMEOUT_S, connected
from celery_outbox.ops.metrics import QueueDepth, QueueProbe
from celery_outbox.runtime import Context


def queue_depths(url: str, queues: Sequence[tuple[str, str]], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 transport_options: Mapping[str, Any] | None = None) -> list[QueueDepth]:
    """``(queue, consumer)`` pairs -> their depths on the broker at ``url``; raises when it cannot connect."""
    with connected(url, timeout_s=timeout_s, transport_options=transport_options) as conn:
        counts_consumers = conn.transport.driver_type not in ("redis", "memory")
        found: list[QueueDepth] = []
        channel = conn.channel()
        try:
            for queue, consumer in queues:
                try:
                    _name, messages, consumers = channel.queue_declare(queue=queue, passive=True)
                except conn.channel_errors:  # not declared yet: nothing waits there (RabbitMQ closed the channel)
                    channel.close()
                    channel = conn.channel()
                    messages, consumers = 0, 0
                found.append(QueueDepth(queue=queue, consumer=consumer, messages=int(messages),
                                        consumers=int(consumers) if counts_consumers else None))
        finally:
            channel.close()
        return found


def queue_probe(ctx: Context, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> QueueProbe:
    """A probe for ``metrics.make_registry``: every known consumer's queue ``<namespace>.<consumer>``, asked at
    each scrape (consumers registered later are included)."""

    def probe() -> list[QueueDepth]:
        namespace = ctx.settings.namespace
        url = ctx.broker_url()
        return queue_depths(url, [(f"{namespace}.{c}", c) for c in ctx.known_consumers()], timeout_s=timeout_s,
                            transport_options=sentinel_options(ctx.settings, url))

    return probe
