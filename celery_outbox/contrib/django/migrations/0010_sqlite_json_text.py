"""The library's Alembic revision co0008: it gives SQLite tables Alembic created the shape this app's migrations
already give them (JSON as TEXT with a ``json_valid`` CHECK, AUTOINCREMENT keys), so here there is nothing to
change; the revision is recorded, as each revision is (0004_schema_version)."""

from __future__ import annotations

import importlib

from django.db import migrations

# The version-stamping operation lives in the migration that created the version table.
StampRevision = importlib.import_module("celery_outbox.contrib.django.migrations.0004_schema_version").StampRevision


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("celery_outbox", "0009_autovacuum")]

    operations = [StampRevision("co0008", "co0007")]
