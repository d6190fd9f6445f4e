"""The reconciler's queue probe on a real broker (relay/queues.py): what each queue holds right now.

One connection per ask (the reconciler asks only while it holds messages no consumer recorded and
the consumers' progress does not prove lost), one passive declare per queue (it creates nothing).
RabbitMQ answers with the ready-message and consumer counts; it cannot list what its consumers hold
unacknowledged, so the reconciler treats an empty queue with consumers attached as empty only once it
has stayed so for a whole reconcile floor (relay/reconcile.py). Redis (kombu's virtual transport)
answers with the lengths of the queue's lists, every priority summed, and kombu keeps what workers
took and have not acknowledged (prefetched, running, a retry waiting for its countdown) in one hash
for all queues: its message ids are read once per ask. A queue not declared yet holds nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from celery_outbox.celery.probe import DEFAULT_TIMEOUT_S, connected
from celery_outbox.relay.queues import QueueState


def _unacked_ids(channel: Any) -> frozenset[str]:
    """The message ids in kombu's Redis unacked hash: each entry is ``[message, exchange, routing_key]``."""
    found: set[str] = set()
    for raw in channel.client.hvals(channel.unacked_key):
        try:
            message = json.loads(raw)[0]
            headers = message.get("headers") or {}
        except (ValueError, TypeError, IndexError, KeyError, AttributeError):
            continue  # not kombu's shape: it cannot be one of ours
        for key in ("outbox_message_id", "id"):
            value = headers.get(key)
            if isinstance(value, str):
                found.add(value)
    return frozenset(found)


class KombuQueueInspector:
    """``QueueInspector`` for the broker at ``broker_url``, each ask bounded by ``timeout_s``."""

    def __init__(self, *, broker_url: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                 transport_options: Mapping[str, Any] | None = None) -> None:
        self.broker_url = broker_url
        self.timeout_s = timeout_s
        self.transport_options = dict(transport_options or {})  # a sentinel:// broker's master name

    def queue_states(self, queues: Sequence[str]) -> Mapping[str, QueueState]:
        with connected(self.broker_url, timeout_s=self.timeout_s, transport_options=self.transport_options) as conn:
            redis = conn.transport.driver_type == "redis"
            states: dict[str, QueueState] = {}
            channel = conn.channel()
            try:
                unacked = _unacked_ids(channel) if redis else None
                for queue in queues:
                    try:
                        _name, ready, consumers = channel.queue_declare(queue=queue, passive=True)
                    except conn.channel_errors:  # not declared yet (RabbitMQ closed the channel): holds nothing
                        channel.close()
                        channel = conn.channel()
                        ready, consumers = 0, 0
                    states[queue] = QueueState(ready=int(ready), unacked=unacked,
                                               consumers=None if redis else int(consumers))
            finally:
                channel.close()
            return states
