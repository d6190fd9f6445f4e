"""The reference deployment's consumers: Shipping, Billing and Search, each an idempotent consumer.

The confirmation e-mail is not a consumer: the Orders service enqueues it as an idempotent task
(orders/tasks.py). ``consumers.email`` stays as the documented example of a consumer with a
``prepare`` step (an effect outside the database); this deployment does not register it.
"""

from __future__ import annotations

from celery_outbox import ConsumerRegistry, Outbox


def default_registry() -> ConsumerRegistry:
    """A new registry with the shipped consumers: shipping, billing, search."""
    from consumers.billing import billing
    from consumers.search import search
    from consumers.shipping import shipping

    return ConsumerRegistry(specs=[shipping, billing, search])


def register(outbox: Outbox) -> None:
    """Declare this deployment's consumers on ``outbox`` (Celery tasks on its app, one queue each)."""
    for spec in default_registry():
        outbox.include(spec)
