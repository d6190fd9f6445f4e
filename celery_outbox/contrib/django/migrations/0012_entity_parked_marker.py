"""An entity's version row says whether the entity may have parked messages (``parked``; existing rows: 1, may
have some), and the trigger that sets it when a message is parked (``schema.parked_trigger``: also by a worker of
the release before, during a rolling deploy), as the library's Alembic revision co0010 creates them
(inbox/ordering.py)."""

from __future__ import annotations

import importlib
from typing import Any

from django.db import migrations, models

from celery_outbox.schema import define_tables, parked_trigger

# The version-stamping operation lives in the migration that created the version table.
StampRevision = importlib.import_module("celery_outbox.contrib.django.migrations.0004_schema_version").StampRevision


def create_trigger(apps: Any, schema_editor: Any) -> None:
    for statement in parked_trigger(define_tables()).create(schema_editor.connection.vendor):
        schema_editor.execute(statement, params=None)


def drop_trigger(apps: Any, schema_editor: Any) -> None:
    for statement in parked_trigger(define_tables()).drop(schema_editor.connection.vendor):
        schema_editor.execute(statement, params=None)


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("celery_outbox", "0011_dead_letter_task_id")]

    operations = [
        migrations.AddField(
            model_name="entityversion",
            name="parked",
            field=models.IntegerField(db_default=1),
        ),
        migrations.RunPython(create_trigger, drop_trigger),
        StampRevision("co0010", "co0009"),
    ]
