"""Tasks enqueued inside a Django ``TestCase``: see them, and run them, inside the test's own transaction.

``TestCase`` wraps each test in ``atomic()``, so ``on_commit`` never fires and a task sent with
``.delay()`` stays a pending outbox row (contrib/django/enqueue.py) that the test's rollback removes;
the relay (another connection) cannot even see it. These helpers read the rows on Django's own
connection, build each message with the relay's own ``messages.task_row_message`` (so a row the relay
would refuse fails here too), and run the task eagerly in this process (docs/django.md, "Tests"):

    class PlaceOrderTest(TestCase):
        def test_confirmation_is_sent(self):
            self.client.post("/orders", {...})                      # the view calls send_confirmation.delay()
            [message] = enqueued_tasks(outbox)                     # what the relay would publish
            assert message.headers["task"] == "shop.send_confirmation"
            run_enqueued_tasks(outbox)                              # and what a worker would run

Tasks run with Celery's ``Task.apply`` on this thread as a worker runs them, headers (trace context)
and routing key (the real queue) included: the same runner as the SQLAlchemy twin
(``celery_outbox.testing.tasks.apply_message``). A task writing through the Django ORM sees and writes
the test's uncommitted data; a countdown or eta is not waited for. A task that ``.delay()``s
another one (or a chain's next step) writes a new row, run in the next round.
"""

from __future__ import annotations

from typing import Any

from django.db import router

from celery_outbox.messages import TaskMessage, is_task_row
from celery_outbox.testing.tasks import apply_message, row_message, run_in_rounds

__all__ = ["enqueued_tasks", "run_enqueued_tasks"]


def _pending_task_rows(using: str | None) -> list[Any]:
    from celery_outbox.contrib.django.models import OutboxMessage

    alias = using or router.db_for_write(OutboxMessage)
    rows = OutboxMessage.objects.using(alias).filter(published_at_ms__isnull=True, dead_lettered_at_ms__isnull=True)
    return [row for row in rows.order_by("seq") if is_task_row(row.headers)]


def enqueued_tasks(outbox: Any, *, using: str | None = None) -> list[TaskMessage]:
    """The task messages pending in the outbox, in order, as the relay would publish them (nothing is marked)."""
    return [row_message(outbox, row) for row in _pending_task_rows(using or getattr(outbox, "using", None))]


def run_enqueued_tasks(outbox: Any, *, using: str | None = None, max_rounds: int = 100, throw: bool = True,
                       ) -> list[Any]:
    """``celery_outbox.testing.run_enqueued_tasks`` on the rows of Django's connection ``using`` (the outbox's
    alias by default): the same rounds (``run_in_rounds``), results and errors."""

    def take() -> list[TaskMessage]:
        messages = []
        for row in _pending_task_rows(using or getattr(outbox, "using", None)):
            messages.append(row_message(outbox, row))
            row.published_at_ms = outbox.clock.now_ms()  # the relay's mark: the row never runs twice
            row.save(update_fields=["published_at_ms"])
        return messages

    # The rounds are the SQLAlchemy twin's (testing/tasks.py); only where the rows are differs.
    return run_in_rounds(take, lambda m: apply_message(outbox.app, m, throw=throw), max_rounds=max_rounds)
