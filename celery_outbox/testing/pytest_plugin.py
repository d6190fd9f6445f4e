"""pytest fixtures for your own tests, loaded by pytest once the package is installed (a ``pytest11``
entry point; ``-p no:celery_outbox.testing.pytest_plugin`` turns them off).

- ``outbox_publisher``: a broker stand-in that records what the relay published (and can be told to fail);
- ``manual_clock``: a clock your test moves with ``advance(ms)``: no sleeps, no wall time;
- ``outbox_tasks``: the outbox's tasks and events run in this process, for the ``outbox`` fixture you
  define in your conftest (your app's ``Outbox`` on your test database), which it closes afterwards:

      @pytest.fixture
      def outbox():
          return create_app(testing=True).extensions["celery_outbox"]

      def test_confirmation(outbox_tasks):
          client.post("/orders", json={"id": "o-1"})       # the view calls send_confirmation.delay()
          [message] = outbox_tasks.enqueued()               # what the relay would publish
          outbox_tasks.run()                                # and what a worker would run

Importing this module imports no celery, no SQLAlchemy session and no app of yours: fixtures import lazily.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from celery_outbox.clock import ManualClock
    from celery_outbox.inbox.outcome import Outcome
    from celery_outbox.messages import TaskMessage
    from celery_outbox.testing.memory import InMemoryPublisher


@pytest.fixture
def outbox_publisher() -> InMemoryPublisher:
    """A broker stand-in that records what the relay published (and can be told to fail)."""
    from celery_outbox.testing.memory import InMemoryPublisher

    return InMemoryPublisher()


@pytest.fixture
def manual_clock() -> ManualClock:
    """A clock your test moves with ``advance(ms)``: no sleeps, no wall time."""
    from celery_outbox.clock import ManualClock

    return ManualClock()


class OutboxTasks:
    """``enqueued()``, ``run()`` and ``run_pending()`` of one outbox, publishing into one in-memory publisher."""

    def __init__(self, outbox: Any, publisher: InMemoryPublisher) -> None:
        self.outbox = outbox
        self.publisher = publisher

    def enqueued(self, **kwargs: Any) -> list[TaskMessage]:
        """``celery_outbox.testing.enqueued_tasks``: pending task messages, nothing marked."""
        from celery_outbox.testing.tasks import enqueued_tasks

        return enqueued_tasks(self.outbox, **kwargs)

    def run(self, **kwargs: Any) -> list[Any]:
        """``celery_outbox.testing.run_enqueued_tasks``: run the pending tasks (and what they send) eagerly."""
        from celery_outbox.testing.tasks import run_enqueued_tasks

        return run_enqueued_tasks(self.outbox, **kwargs)

    def run_pending(self) -> dict[str, list[Outcome]]:
        """``celery_outbox.testing.run_pending``: relay once, then every event's consumer and every task."""
        from celery_outbox.testing import run_pending

        return run_pending(self.outbox, self.publisher)


@pytest.fixture
def outbox_tasks(outbox: Any, outbox_publisher: InMemoryPublisher) -> Iterator[OutboxTasks]:
    """Run the ``outbox`` fixture's tasks and events in this process; closes the outbox afterwards."""
    yield OutboxTasks(outbox, outbox_publisher)
    outbox.close()
