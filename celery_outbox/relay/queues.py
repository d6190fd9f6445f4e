"""The reconciler's second port to a broker: what a queue holds right now.

The reconciler (relay/reconcile.py) re-sends a message only on evidence that it is lost
(docs/guarantees.md, "When the reconciler re-sends"). One kind of evidence is the broker saying that
the message's queue holds no copy of it: nothing waiting and, where the broker says so, nothing taken
and unacknowledged. This module is that question as plain data, so the core never imports kombu:
``celery_outbox.celery.queue_inspector`` answers it from a real broker, ``celery_outbox.testing.memory``
from a script.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, kw_only=True)
class QueueState:
    """One queue as the broker reports it.

    ``ready``: messages waiting, not taken by any worker (Redis: the lengths of the queue's lists, all
    priorities; RabbitMQ: the passive declare's message count). ``unacked``: the ids of the messages
    workers took and have not acknowledged, when the broker can list them (Redis: kombu's unacked
    hash, every queue's); None when it cannot (RabbitMQ). ``consumers``: the workers attached, when the
    broker counts them (RabbitMQ); None when it does not (Redis).
    """

    ready: int
    unacked: frozenset[str] | None = None
    consumers: int | None = None

    def holds_no_copy_of(self, message_id: str) -> bool | None:
        """True: no copy of ``message_id`` is waiting or taken here. False: one may be. None: nothing
        waits, but the broker cannot say what its workers hold (RabbitMQ with consumers attached)."""
        if self.ready > 0:
            return False
        if self.unacked is not None:
            return message_id not in self.unacked
        if self.consumers == 0:  # no consumer, so nothing can be taken and unacknowledged
            return True
        return None


@runtime_checkable
class QueueInspector(Protocol):
    """What the reconciler asks a broker. Implementations: kombu (celery/queue_inspector.py), in-memory."""

    def queue_states(self, queues: Sequence[str]) -> Mapping[str, QueueState]:
        """The state of each of ``queues`` (a queue that does not exist holds nothing). Raises any
        exception when the broker cannot be asked: the reconciler then has no broker evidence for
        this pass and re-sends only what the consumers' progress proves lost."""
        ...
