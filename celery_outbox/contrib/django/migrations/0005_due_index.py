"""The relay's due-time index (pending rows by next_attempt_at_ms, seq): the library's Alembic co0003."""

from __future__ import annotations

import importlib

from django.db import migrations, models
from django.db.models import Q

# The version-stamping operation lives in the migration that created the version table.
StampRevision = importlib.import_module("celery_outbox.contrib.django.migrations.0004_schema_version").StampRevision


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("celery_outbox", "0004_schema_version")]

    operations = [
        migrations.AddIndex(
            model_name="outboxmessage",
            index=models.Index(fields=["next_attempt_at_ms", "seq"], name="ix_outbox_due",
                               condition=Q(published_at_ms__isnull=True) & Q(dead_lettered_at_ms__isnull=True)),
        ),
        StampRevision("co0003", "co0002"),
    ]
