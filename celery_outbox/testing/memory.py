"""An in-memory publisher with scriptable failures, for this project's tests and for users' own.

It records every message "the broker got" (``messages()``, ``events()``, ``tasks()``) and can be told
to be unreachable N times, to reject given message ids (N times or forever), to take a batch and then die before
answering (a relay crash after publish, before mark), or to take part of a batch and then lose the
connection. It is thread-safe so several relays can share one.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

from celery_outbox.errors import BrokerUnavailableError
from celery_outbox.messages import TaskMessage
from celery_outbox.relay.publisher import PublishReport
from celery_outbox.relay.queues import QueueState


class PublisherCrashed(BaseException):
    """Raised after the broker got the batch, standing in for the relay process dying right there.

    A ``BaseException`` on purpose: nothing in the relay catches it, like nothing survives SIGKILL.
    """


@dataclass
class _Rejection:
    error: str
    times: int | None  # None: forever


class InMemoryQueues:
    """The reconciler's view of the broker's queues (relay/queues.py), scripted.

    By default every queue holds nothing (an in-memory broker whose messages were all delivered):
    a published message no consumer recorded is then lost as soon as it is older than the reconcile
    floor. ``set`` scripts a backlog, unacked messages or attached consumers; ``fail`` makes the next
    asks raise, like a broker that cannot be reached.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, QueueState] = {}
        self._failures = 0
        self.asked: list[tuple[str, ...]] = []

    def set(self, queue: str, *, ready: int = 0, unacked: Sequence[str] | None = (),
            consumers: int | None = None) -> None:
        """``queue`` now holds ``ready`` waiting messages and the ``unacked`` ids (None: the broker cannot
        list them, as RabbitMQ), with ``consumers`` attached (None: not counted, as Redis)."""
        with self._lock:
            self._states[queue] = QueueState(ready=ready, consumers=consumers,
                                             unacked=None if unacked is None else frozenset(unacked))

    def fail(self, times: int = 1) -> None:
        """The next ``times`` asks raise ``BrokerUnavailableError``."""
        with self._lock:
            self._failures += times

    def queue_states(self, queues: Sequence[str]) -> Mapping[str, QueueState]:
        with self._lock:
            self.asked.append(tuple(queues))
            if self._failures:
                self._failures -= 1
                raise BrokerUnavailableError("broker unavailable: queue probe refused")
            return {q: self._states.get(q, QueueState(ready=0, unacked=frozenset())) for q in queues}


class InMemoryPublisher:
    """Records published messages; see the module docstring for the failure scripts. Its ``queues``
    (``InMemoryQueues``) answer the reconciler's questions about the broker's queues."""

    def __init__(self, *, before_publish: Callable[[Sequence[TaskMessage]], None] | None = None) -> None:
        self.published: list[TaskMessage] = []
        self.calls = 0
        self.unavailable_calls = 0
        self.closed = False
        self._before_publish = before_publish
        self._lock = threading.Lock()
        self._unavailable: list[str] = []
        self._rejections: dict[str, _Rejection] = {}
        self._crashes = 0
        self._partial: list[int] = []
        self.queues = InMemoryQueues()

    # -- scripting -------------------------------------------------------------------------------
    def fail_unavailable(self, times: int = 1, *, error: str = "connection refused") -> None:
        """The next ``times`` batches raise ``BrokerUnavailableError`` and deliver nothing."""
        with self._lock:
            self._unavailable.extend([error] * times)

    def reject(self, message_id: uuid.UUID | str, *, times: int | None = None,
               error: str = "broker nacked the message") -> None:
        """Reject every message of this outbox ``message_id`` (``times`` batches, or forever)."""
        with self._lock:
            self._rejections[str(message_id)] = _Rejection(error=error, times=times)

    def recover(self) -> None:
        """Forget every scripted failure: the broker is healthy again."""
        with self._lock:
            self._unavailable.clear()
            self._rejections.clear()
            self._crashes = 0
            self._partial.clear()

    def crash_after_delivery(self, times: int = 1) -> None:
        """The next ``times`` batches reach the broker, then ``PublisherCrashed`` is raised."""
        with self._lock:
            self._crashes += times

    def unavailable_after(self, delivered: int) -> None:
        """The next batch delivers its first ``delivered`` messages, then the connection is lost."""
        with self._lock:
            self._partial.append(delivered)

    # -- reading ---------------------------------------------------------------------------------
    def messages(self) -> list[TaskMessage]:
        """Every message the broker got, in order (a copy): events (one per consumer) and tasks."""
        with self._lock:
            return list(self.published)

    def events(self) -> list[TaskMessage]:
        """The published event deliveries (one per event and consumer), in order."""
        with self._lock:
            return [m for m in self.published if m.exchange is None]

    def clear(self) -> None:
        """Forget what was published (the scripted failures stay)."""
        with self._lock:
            self.published.clear()

    def message_ids(self) -> list[str]:
        """Outbox message ids of every published message, one per (event, consumer) or task, in order."""
        with self._lock:
            return [m.message_id for m in self.published]

    def deliveries(self) -> Counter[tuple[str, str]]:
        """How many times each (message_id, consumer) reached the broker: > 1 is a duplicate."""
        with self._lock:
            return Counter((m.message_id, m.consumer) for m in self.published)

    def tasks(self) -> list[TaskMessage]:
        """The published messages of tasks enqueued through the outbox (not event deliveries), in order."""
        with self._lock:
            return [m for m in self.published if m.exchange is not None]

    def duplicates(self) -> int:
        return sum(n - 1 for n in self.deliveries().values() if n > 1)

    # -- Publisher -------------------------------------------------------------------------------
    def publish_batch(self, messages: Sequence[TaskMessage]) -> PublishReport:
        if self._before_publish is not None:
            self._before_publish(messages)
        with self._lock:
            self.calls += 1
            if self.closed:
                raise BrokerUnavailableError("publisher is closed")
            if self._unavailable:
                self.unavailable_calls += 1
                raise BrokerUnavailableError(f"broker unavailable: {self._unavailable.pop(0)}")
            if self._partial:
                n = self._partial.pop(0)
                self.published.extend(messages[:n])
                self.unavailable_calls += 1
                raise BrokerUnavailableError(f"broker unavailable: connection lost after {n} message(s)")
            rejected: dict[int, str] = {}
            for i, m in enumerate(messages):
                rule = self._rejections.get(m.message_id)
                if rule is not None:
                    rejected[i] = rule.error
                else:
                    self.published.append(m)
            for mid, rule in list(self._rejections.items()):
                hit = any(messages[i].message_id == mid for i in rejected)
                if hit and rule.times is not None:
                    rule.times -= 1
                    if rule.times <= 0:
                        del self._rejections[mid]
            if self._crashes:
                self._crashes -= 1
                raise PublisherCrashed("the relay died after the broker got the batch")
            return PublishReport(count=len(messages), rejected=rejected)

    def queue_states(self, queues: Sequence[str]) -> Mapping[str, QueueState]:
        """The reconciler's question about the broker (relay/queues.py), answered by ``self.queues``."""
        return self.queues.queue_states(queues)

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> InMemoryPublisher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
