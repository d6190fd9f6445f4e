"""Deduplicate by key: ``dedup_key`` and the partial unique index ``ux_outbox_dedup``, as the library's
Alembic revision co0005 creates them (docs/scheduled.md, "Deduplicate by key")."""

from __future__ import annotations

import importlib

from django.db import migrations, models
from django.db.models import Q

# The version-stamping operation lives in the migration that created the version table.
StampRevision = importlib.import_module("celery_outbox.contrib.django.migrations.0004_schema_version").StampRevision


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("celery_outbox", "0006_dead_letter_groups")]

    operations = [
        migrations.AddField(
            model_name="outboxmessage",
            name="dedup_key",
            field=models.CharField(blank=True, max_length=200, null=True),
        ),
        migrations.AddConstraint(
            model_name="outboxmessage",
            constraint=models.UniqueConstraint(
                fields=["dedup_key"], name="ux_outbox_dedup",
                condition=Q(published_at_ms__isnull=True) & Q(dead_lettered_at_ms__isnull=True)
                & Q(dedup_key__isnull=False)),
        ),
        StampRevision("co0005", "co0004"),
    ]
