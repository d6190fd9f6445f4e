"""The Postgres NOTIFY trigger that wakes a standalone relay (``outbox relay`` LISTENs on ``outbox_pending``).

The same function and trigger the library's Alembic migration creates; nothing on other databases.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

FUNCTION = "outbox_notify"
TABLE = "outbox_messages"
CHANNEL = "outbox_pending"


def create_trigger(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"CREATE OR REPLACE FUNCTION {FUNCTION}() RETURNS trigger AS $$ "
                          f"BEGIN PERFORM pg_notify('{CHANNEL}', ''); RETURN NULL; END $$ LANGUAGE plpgsql")
    schema_editor.execute(f"CREATE TRIGGER {FUNCTION} AFTER INSERT ON {TABLE} FOR EACH STATEMENT "
                          f"EXECUTE FUNCTION {FUNCTION}()")


def drop_trigger(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"DROP TRIGGER IF EXISTS {FUNCTION} ON {TABLE}")
    schema_editor.execute(f"DROP FUNCTION IF EXISTS {FUNCTION}()")


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("celery_outbox", "0001_initial")]

    operations = [migrations.RunPython(create_trigger, drop_trigger)]
