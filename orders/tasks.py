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

Why a run costs a transaction before the inbox transaction (bench/task_statements.py counts them):
the order is read (one statement) in a transaction of its own, then the provider is called (the
fake provider's ``sent_emails`` upsert and commit stand for that remote call), then the inbox row
commits. The read cannot ride in the inbox transaction, since the call must come between the read
and the inbox commit and must not hold that transaction open (its row lock, SQLite's write lock,
``idle_in_transaction_session_timeout``). The sent record cannot ride in it either: it is the
provider's state, not ours. A crash between the call and the inbox commit is what the idempotency key
absorbs, and that only works if the provider's record survives without our commit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox import ConfigError, MalformedMessageError, Outbox
from celeryconfig import TASK_QUEUES
from consumers.email_provider import EmailProvider, FakeEmailProvider, idempotency_key
from orders.models import Order, OrderLine

NAME = "orders.send_confirmation_email"
QUEUE = TASK_QUEUES[NAME]  # "email": celeryconfig routes the task to <namespace>.email
SENT = "confirmation_email_sent"
FAILED = "confirmation_email_failed"

ProviderFactory = Callable[[Session], EmailProvider]

# What the e-mail says of an order, in ONE statement: its columns and its item count (a correlated sum),
# no ORM objects (``Session.get`` and the lazy load of ``lines`` were two statements per e-mail).
_ITEMS = sa.select(sa.func.coalesce(sa.func.sum(OrderLine.quantity), 0)).where(
    OrderLine.order_id == Order.id).scalar_subquery()
_SUMMARY = sa.select(Order.id, Order.email, Order.total_cents, Order.currency, _ITEMS).where(
    Order.id == sa.bindparam("order_id"))


def fake_provider(session: Session) -> EmailProvider:
    return FakeEmailProvider(session=session)


def confirmation_key(task_id: str) -> str:
    """The provider's idempotency key of one task: every run of that task id derives the same one."""
    return idempotency_key(task_id, NAME)


def send_confirmation(session: Session, provider: EmailProvider, *, task_id: str, order_id: Any) -> str:
    """Send order ``order_id``'s confirmation through ``provider``, keyed by ``task_id``; returns the key."""
    if not isinstance(order_id, str):
        raise MalformedMessageError(f"{NAME} takes an order id (a string), got {type(order_id).__name__}")
    order = session.execute(_SUMMARY, {"order_id": order_id}).first()
    if order is None:
        raise MalformedMessageError(f"{NAME}: order {order_id!r} does not exist")
    oid, email, total_cents, currency, items = order
    key = confirmation_key(task_id)
    provider.send(
        to=email,
        subject=f"Order {oid} confirmed",
        body=f"Thank you for order {oid}: {items} item(s), {total_cents / 100:.2f} {currency}.",
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
