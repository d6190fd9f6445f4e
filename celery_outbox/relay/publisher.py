"""The relay's one port to a broker: publish a batch, say per message whether the broker has it.

Two kinds of failure are kept apart because the relay reacts differently (docs/design.md, rule 3): a message
the broker refused (nack, returned, unroutable) is reported in the ``PublishReport`` and charged to
its row; a broker that cannot be reached raises ``BrokerUnavailableError`` and is charged to nobody.
A batch interrupted by ``BrokerUnavailableError`` may already be partly on the broker; the relay then
leaves every row of the batch pending, so those messages are published again (a duplicate the inbox
absorbs), never lost.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol, runtime_checkable

from celery_outbox.messages import TaskMessage


@dataclass(frozen=True, kw_only=True)
class PublishReport:
    """The outcome of one ``publish_batch``: ``rejected`` maps a message's index in the batch to why.

    Every index not in ``rejected`` is confirmed: the broker has the message (as durably as the
    broker's configuration allows).
    """

    count: int
    rejected: Mapping[int, str] = field(default_factory=dict)

    @property
    def confirmed(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.count) if i not in self.rejected)

    def is_confirmed(self, index: int) -> bool:
        return 0 <= index < self.count and index not in self.rejected


@runtime_checkable
class Publisher(Protocol):
    """What ``dispatch_batch`` needs from a broker. Implementations: Kombu, in-memory."""

    def publish_batch(self, messages: Sequence[TaskMessage]) -> PublishReport:
        """Publish all ``messages``; return per-message outcomes.

        Raises ``BrokerUnavailableError`` when the broker cannot be reached (connection refused,
        timeout, lost connection), possibly after part of the batch reached it.
        """
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Publisher: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...


@runtime_checkable
class SendsAhead(Protocol):
    """A publisher that can put a batch on the wire and return before the broker answers.

    ``send_batch`` writes every message and returns a call that waits for the confirms and returns
    the ``PublishReport`` (both may raise ``BrokerUnavailableError``). Between the two the relay
    claims and builds its next batch (relay/loop.py), so database work overlaps the broker's. Only
    one batch may be outstanding: the next ``send_batch`` comes after the previous wait returned.
    """

    def send_batch(self, messages: Sequence[TaskMessage]) -> Callable[[], PublishReport]: ...
