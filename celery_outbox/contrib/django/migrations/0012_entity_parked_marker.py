"""An entity's version row says whether the entity may have parked messages (``parked``; existing rows: 1, may
have some), as the library's Alembic revision co0010 creates it (inbox/ordering.py)."""

from __future__ import annotations

import importlib

from django.db import migrations, models

# The version-stamping operation lives in the migration that created the version table.
StampRevision = importlib.import_module("celery_outbox.contrib.django.migrations.0004_schema_version").StampRevision


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("celery_outbox", "0011_dead_letter_task_id")]

    operations = [
        migrations.AddField(
            model_name="entityversion",
            name="parked",
            field=models.IntegerField(db_default=1),
        ),
        StampRevision("co0010", "co0009"),
    ]
