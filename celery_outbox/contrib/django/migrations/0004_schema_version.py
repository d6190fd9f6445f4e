"""The library's schema version, recorded as ``outbox db upgrade`` records it: one schema, two ways to create it.

``manage.py migrate`` creates exactly the tables (and the Postgres trigger) of the library's Alembic revision
``co0002`` (tests/django/test_django_schema.py); this migration writes that revision into the library's own
version table, ``outbox_schema_version`` (Alembic's layout), so ``outbox db check``, ``outbox check`` and the
readiness probe accept a Django-migrated database, and ``outbox db upgrade`` finds nothing to do instead of
failing on tables and a trigger that exist. A later migration of this app that follows a new Alembic revision
updates the row with ``StampRevision`` (below).
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

VERSION_TABLE = "outbox_schema_version"
REVISION = "co0002"


class StampRevision(migrations.RunPython):  # type: ignore[misc]
    """Record ``revision`` (an Alembic revision of ``celery_outbox/migrations``) as the database's library version;
    reversed, record ``previous`` (None: no version)."""

    def __init__(self, revision: str, previous: str | None) -> None:
        def stamp(to: str | None) -> Any:
            def run(apps: Any, schema_editor: Any) -> None:
                schema_editor.execute(f"DELETE FROM {VERSION_TABLE}")
                if to is not None:
                    schema_editor.execute(f"INSERT INTO {VERSION_TABLE} (version_num) VALUES (%s)", [to])
            return run

        super().__init__(stamp(revision), stamp(previous))


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("celery_outbox", "0003_task_receipts")]

    operations = [
        migrations.RunSQL(
            f"CREATE TABLE {VERSION_TABLE} (version_num VARCHAR(32) NOT NULL, "
            f"CONSTRAINT {VERSION_TABLE}_pkc PRIMARY KEY (version_num))",
            f"DROP TABLE {VERSION_TABLE}",
        ),
        StampRevision(REVISION, None),
    ]
