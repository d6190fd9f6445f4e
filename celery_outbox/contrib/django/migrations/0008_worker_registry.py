"""Deploy-safe publishing: the worker registry ``outbox_workers``, ``held_for`` and ``ix_outbox_held``, as
the library's Alembic revision co0006 creates them (docs/scheduled.md, "Deploys")."""

from __future__ import annotations

import importlib

from django.db import migrations, models
from django.db.models import Q

# The version-stamping operation lives in the migration that created the version table.
StampRevision = importlib.import_module("celery_outbox.contrib.django.migrations.0004_schema_version").StampRevision


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("celery_outbox", "0007_dedup_key")]

    operations = [
        migrations.CreateModel(
            name="WorkerRegistration",
            fields=[
                ("id", models.UUIDField(primary_key=True, serialize=False)),
                ("name", models.CharField(max_length=255)),
                ("queues", models.JSONField()),
                ("tasks", models.JSONField()),
                ("started_at_ms", models.BigIntegerField()),
                ("heartbeat_at_ms", models.BigIntegerField()),
            ],
            options={"db_table": "outbox_workers"},
        ),
        migrations.AddField(
            model_name="outboxmessage",
            name="held_for",
            field=models.CharField(blank=True, max_length=300, null=True),
        ),
        migrations.AddIndex(
            model_name="outboxmessage",
            index=models.Index(
                fields=["held_for"], name="ix_outbox_held",
                condition=Q(published_at_ms__isnull=True) & Q(dead_lettered_at_ms__isnull=True)
                & Q(held_for__isnull=False)),
        ),
        StampRevision("co0006", "co0005"),
    ]
