"""A dead letter's ``task_id`` (the Celery task id of the delivery that gave up, replayed under it), as the
library's Alembic revision co0009 creates it (docs/operations.md, "Flower")."""

from __future__ import annotations

import importlib

from django.db import migrations, models

# The version-stamping operation lives in the migration that created the version table.
StampRevision = importlib.import_module("celery_outbox.contrib.django.migrations.0004_schema_version").StampRevision


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("celery_outbox", "0010_sqlite_json_text")]

    operations = [
        migrations.AddField(
            model_name="consumerdeadletter",
            name="task_id",
            field=models.CharField(blank=True, max_length=64, null=True),
        ),
        StampRevision("co0009", "co0008"),
    ]
