"""Django Tasks (``django.tasks``, Django 6) on the outbox backend, for tests/django/test_django_task_backend.py.

Module level, as Django requires; imported only where ``django.tasks`` exists.
"""

from __future__ import annotations

from typing import Any

from django.tasks import TaskContext, task
from shop.models import Order

FAILURES: dict[str, int] = {}
"""order id -> how many more runs of ``flaky_order`` raise (the test sets it)."""


def make_order(order_id: str, total_cents: int) -> None:
    Order.objects.create(id=order_id, customer_id="tasks", email="tasks@example.com", currency="EUR",
                         total_cents=total_cents, created_at_ms=0)


@task(backend="outbox")  # type: ignore[untyped-decorator]
def record_order(order_id: str, total_cents: int = 0) -> dict[str, Any]:
    """The effect: a row written with the Django ORM inside the inbox transaction."""
    make_order(order_id, total_cents)
    return {"order_id": order_id}


@task(backend="outbox", takes_context=True)  # type: ignore[untyped-decorator]
def flaky_order(context: TaskContext, order_id: str) -> int:
    """Writes its row, then raises while ``FAILURES[order_id]`` lasts: the row must roll back each time."""
    make_order(f"{order_id}-attempt-{context.attempt}", 0)
    if FAILURES.get(order_id, 0) > 0:
        FAILURES[order_id] -= 1
        raise RuntimeError(f"transient failure of {order_id}")
    return int(context.attempt)


@task(backend="outbox", queue_name="mail")  # type: ignore[untyped-decorator]
def mail_order(order_id: str) -> None:
    """A task on another Django queue: the Celery queue of the same name."""
