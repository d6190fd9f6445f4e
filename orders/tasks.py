"""The Orders service's confirmation e-mail: an idempotent Celery task enqueued with the order.

``place_order`` calls ``confirmation_email_task(outbox).delay(order_id)`` inside
``outbox.transaction(session)``: the task is an outbox row that commits or rolls back with the order,
and the relay publishes it to ``<namespace>.email`` (docs/tasks.md, "Transactional enqueue").

The e-mail is an effect OUTSIDE the database, so it is handled like a consumer's ``prepare`` step
(celery_outbox/inbox/handle.py). The function of an ``@outbox.task`` runs inside the inbox
transaction, after the inbox row ``(task id, task:<name>)`` is claimed
(celery_outbox/celery/idempotent_task.py): calling a remote provider there would hold that lock (on
SQLite, the whole database's write lock) during a slow call. The provider is therefore called just
before, in Celery's ``before_start`` hook of the same task, with an idempotency key derived from the
task id. A redelivery, a retry, a relay duplicate or a dead-letter replay of the task keeps its task
id, so it calls the provider again with the SAME key and the provider sends nothing new; a crash
between the provider call and the inbox commit therefore never sends twice. A provider failure is
kept on the request and raised by the task's function, so it takes the task's retry policy and, past
``max_retries``, lands in the dead-letter store, replayable like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from celery_outbox import ConfigError, MalformedMessageError, Outbox
from celeryconfig import TASK_QUEUES
from consumers.email_provider import EmailProvider, FakeEmailProvider, idempotency_key
from orders.models import Order

NAME = "orders.send_confirmation_email"
QUEUE = TASK_QUEUES[NAME]  # "email": celeryconfig routes the task to <namespace>.email
SENT = "confirmation_email_sent"
FAILED = "confirmation_email_failed"

ProviderFactory = Callable[[Session], EmailProvider]


def fake_provider(session: Session) -> EmailProvider:
    return FakeEmailProvider(session=session)


def confirmation_key(task_id: str) -> str:
    """The provider's idempotency key of one task: every run of that task id derives the same one."""
    return idempotency_key(task_id, NAME)


def send_confirmation(session: Session, provider: EmailProvider, *, task_id: str, order_id: Any) -> str:
    """Send order ``order_id``'s confirmation through ``provider``, keyed by ``task_id``; returns the key."""
    if not isinstance(order_id, str):
        raise MalformedMessageError(f"{NAME} takes an order id (a string), got {type(order_id).__name__}")
    order = session.get(Order, order_id)
    if order is None:
        raise MalformedMessageError(f"{NAME}: order {order_id!r} does not exist")
    items = sum(line.quantity for line in order.lines)
    key = confirmation_key(task_id)
    provider.send(
        to=order.email,
        subject=f"Order {order.id} confirmed",
        body=f"Thank you for order {order.id}: {items} item(s), {order.total_cents / 100:.2f} {order.currency}.",
        idempotency_key=key,
    )
    return key


def register(outbox: Outbox, *, provider: ProviderFactory = fake_provider) -> Any:
    """Declare the confirmation e-mail task on ``outbox``'s app; return it. Its queue is celeryconfig's
    route (``<namespace>.email``), so the app must carry this deployment's Celery configuration."""

    def before_start(task: Any, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The provider call, before the inbox transaction opens (module docstring)."""
        task.request.update({SENT: None, FAILED: None})
        try:
            with outbox.sessions()() as session:
                order_id = kwargs.get("order_id", args[0] if args else None)
                task.request.update({SENT: send_confirmation(session, provider(session), task_id=task_id,
                                                             order_id=order_id)})
        except Exception as e:  # raised by the function below: retried, then dead-lettered
            task.request.update({FAILED: e})

    def send_confirmation_email(session: Session, order_id: str) -> str:
        """Commit the inbox row of this task id: the e-mail was handed to the provider in ``before_start``."""
        request = task.request
        failed = request.get(FAILED)
        if isinstance(failed, BaseException):
            raise failed
        sent = request.get(SENT)
        if not isinstance(sent, str):
            raise ConfigError(f"{NAME} ran without its before_start step, so no e-mail was handed to the provider: "
                              "run it as a Celery task (.delay(), or .apply() in tests)")
        return sent

    task = outbox.task(name=NAME, before_start=before_start)(send_confirmation_email)
    return task


def confirmation_email_task(outbox: Outbox) -> Any:
    """The task ``register`` declared on ``outbox``'s app (``.delay(order_id)`` it inside a transaction)."""
    return outbox.app.tasks[NAME]
