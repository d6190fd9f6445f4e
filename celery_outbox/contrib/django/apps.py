"""The Django app config: the library's tables as managed models (``manage.py migrate`` creates them), the
system checks (``manage.py check``), and no silent bypass of the outbox (``binding``)."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig


class OutboxDjangoConfig(AppConfig):  # type: ignore[misc]
    name = "celery_outbox.contrib.django"
    label = "celery_outbox"
    verbose_name = "Transactional outbox"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from celery_outbox.contrib.django import binding, checks

        binding.refuse_unbound_sends()
        checks.register()

    def project_outbox(self) -> Any:
        """The project's ``Outbox`` (``outbox.project_outbox``), asked through Django's app registry by the
        ``outbox`` command, which names no contrib module."""
        from celery_outbox.contrib.django.outbox import project_outbox

        return project_outbox()
