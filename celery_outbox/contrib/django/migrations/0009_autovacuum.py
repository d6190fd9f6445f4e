"""Autovacuum settings of the hot tables on Postgres (a no-op on other databases), as the library's Alembic revision
co0007 sets them (celery_outbox/autovacuum.py; docs/operations.md "Vacuum and bloat")."""

from __future__ import annotations

import importlib
from typing import Any

import sqlalchemy as sa
from django.db import migrations

from celery_outbox import autovacuum
from celery_outbox.schema import define_tables

# The version-stamping operation lives in the migration that created the version table.
StampRevision = importlib.import_module("celery_outbox.contrib.django.migrations.0004_schema_version").StampRevision


def _statements(schema_editor: Any, make: Any) -> None:
    """Run ``make(table, server_version_num)`` for each hot table that is an ordinary table (Postgres only)."""
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cur:
        cur.execute("SHOW server_version_num")
        version = int(cur.fetchone()[0])
        for table in autovacuum.hot_tables(define_tables(sa.MetaData())):  # Django's tables: the default prefix
            cur.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", [f'"{table}"'])
            row = cur.fetchone()
            if row is not None and row[0] == "r":
                schema_editor.execute(make(table, version))


def forwards(apps: Any, schema_editor: Any) -> None:
    _statements(schema_editor, autovacuum.set_sql)


def backwards(apps: Any, schema_editor: Any) -> None:
    _statements(schema_editor, autovacuum.reset_sql)


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("celery_outbox", "0008_worker_registry")]

    operations = [
        migrations.RunPython(forwards, backwards),
        StampRevision("co0007", "co0006"),
    ]
