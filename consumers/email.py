"""E-mail as a consumer of OrderPlaced: the example of a consumer with a ``prepare`` step.

This deployment sends its confirmation e-mail as an idempotent task enqueued with the order
(orders/tasks.py, the one way it sends it) and does not register this consumer; it is kept as the
library's documented example of an effect OUTSIDE the database handled by a consumer, which the
tests of the prepare step use.

The provider call is the consumer's ``prepare`` step: it runs before the inbox transaction (no
database lock held during a slow remote call) with an idempotency key from (message_id, consumer).
If the process dies after the call and before the inbox commit, the redelivery calls again with the
same key and the provider sends nothing new; the inbox row then records the message as handled.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy.orm import Session

from celery_outbox import ConsumerSpec, Envelope, consumer
from consumers.email_provider import EmailProvider, FakeEmailProvider, idempotency_key
from consumers.payloads import order_placed

NAME = "email"

ProviderFactory = Callable[[Session], EmailProvider]


def fake_provider(session: Session) -> EmailProvider:
    return FakeEmailProvider(session=session)


def make_email_consumer(*, provider: ProviderFactory = fake_provider, name: str = NAME) -> ConsumerSpec:
    """The e-mail consumer sending through ``provider`` (a real client in production)."""

    def send_confirmation(session: Session, envelope: Envelope) -> None:
        order = order_placed(envelope)
        provider(session).send(
            to=order.email,
            subject=f"Order {order.order_id} confirmed",
            body=f"Thank you for order {order.order_id}: {order.items} item(s), "
                 f"{order.total_cents / 100:.2f} {order.currency}.",
            idempotency_key=idempotency_key(envelope.message_id, name),
        )

    def record(session: Session, envelope: Envelope) -> None:
        """Nothing more to write: the inbox row is the local record that the e-mail was handled."""

    return consumer(name=name, event="OrderPlaced", prepare=send_confirmation)(record)


email = make_email_consumer()
