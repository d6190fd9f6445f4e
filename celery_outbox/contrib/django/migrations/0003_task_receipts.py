"""Task receipts (``outbox_task_receipts``), as the library's Alembic revision co0002 creates them."""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("celery_outbox", "0002_notify_trigger")]

    operations = [
        migrations.CreateModel(
            name='TaskReceipt',
            fields=[
                ('task_id', models.UUIDField(primary_key=True, serialize=False)),
                ('received_at_ms', models.BigIntegerField()),
            ],
            options={
                'db_table': 'outbox_task_receipts',
                'indexes': [models.Index(fields=['received_at_ms'], name='ix_outbox_receipts_at')],
            },
        ),
    ]
