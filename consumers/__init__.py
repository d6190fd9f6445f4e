"""The reference deployment's consumers: Shipping, Billing, Search and Email, each an idempotent consumer."""

from __future__ import annotations

from celery_outbox import ConsumerRegistry, Outbox


def default_registry() -> ConsumerRegistry:
    """A new registry with the shipped consumers: shipping, billing, search, email."""
    from consumers.billing import billing
    from consumers.email import email
    from consumers.search import search
    from consumers.shipping import shipping

    return ConsumerRegistry(specs=[shipping, billing, search, email])


def register(outbox: Outbox) -> None:
    """Declare this deployment's consumers on ``outbox`` (Celery tasks on its app, one queue each)."""
    for spec in default_registry():
        outbox.include(spec)
