"""The Django app config: unmanaged models only, so this app brings no Django migrations."""

from __future__ import annotations

from django.apps import AppConfig


class OutboxDjangoConfig(AppConfig):  # type: ignore[misc]
    name = "outbox_django"
    label = "outbox_django"
    verbose_name = "Transactional outbox"
    default_auto_field = "django.db.models.BigAutoField"
