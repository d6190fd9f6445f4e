"""App config of the example shop."""

from __future__ import annotations

from django.apps import AppConfig


class ShopConfig(AppConfig):  # type: ignore[misc]
    name = "shop"
    default_auto_field = "django.db.models.BigAutoField"
