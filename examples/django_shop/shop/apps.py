"""App config of the example shop: its consumers join the project's outbox once Django is ready."""

from __future__ import annotations

from django.apps import AppConfig


class ShopConfig(AppConfig):  # type: ignore[misc]
    name = "shop"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from shop_project.celery import outbox

        from shop.consumers import fulfilment

        if fulfilment.name not in outbox.registry:
            outbox.include(fulfilment)
