"""Dead-letter groups (``fingerprint`` and its index), dead letters by message id, the relay's dead rows:
as the library's Alembic revision co0004 creates them, fingerprints of existing dead letters filled in."""

from __future__ import annotations

import importlib
from typing import Any

from django.db import migrations, models

# The version-stamping operation lives in the migration that created the version table.
StampRevision = importlib.import_module("celery_outbox.contrib.django.migrations.0004_schema_version").StampRevision


def fill_fingerprints(apps: Any, schema_editor: Any) -> None:
    from celery_outbox.inbox.fingerprints import fingerprint

    dead_letter = apps.get_model("celery_outbox", "ConsumerDeadLetter")
    for row in dead_letter.objects.filter(fingerprint__isnull=True).only("id", "consumer", "last_error").iterator():
        row.fingerprint = fingerprint(source="consumer", consumer=row.consumer, error=row.last_error)
        row.save(update_fields=["fingerprint"])


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("celery_outbox", "0005_due_index")]

    operations = [
        migrations.AddField(
            model_name='consumerdeadletter',
            name='fingerprint',
            field=models.CharField(blank=True, max_length=32, null=True),
        ),
        migrations.RunPython(fill_fingerprints, migrations.RunPython.noop),
        migrations.AddIndex(
            model_name='consumerdeadletter',
            index=models.Index(condition=models.Q(('replayed_at_ms__isnull', True)), fields=['fingerprint', 'id', 'last_failed_at_ms'],
                               name='ix_outbox_dead_letters_group'),
        ),
        migrations.AddIndex(
            model_name='consumerdeadletter',
            index=models.Index(fields=['message_id'], name='ix_outbox_dead_letters_message'),
        ),
        migrations.AddIndex(
            model_name='outboxmessage',
            index=models.Index(condition=models.Q(('dead_lettered_at_ms__isnull', False)), fields=['seq'],
                               name='ix_outbox_dead'),
        ),
        StampRevision("co0004", "co0003"),
    ]
