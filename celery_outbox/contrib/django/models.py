"""Managed Django models of the library's tables (default prefix ``outbox_``), exactly as
``celery_outbox.schema.define_tables()`` defines them.

``manage.py migrate`` creates them (this app's migrations, incl. the Postgres NOTIFY trigger);
tests/django/test_django_schema.py proves the result equals what ``outbox db upgrade`` (Alembic)
creates. Use one or the other on a database, never both.
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import Q

from celery_outbox.counters import fold, stripe_prefix


class OutboxMessage(models.Model):  # type: ignore[misc]
    """One event waiting for (or past) the relay. ``published_at_ms IS NULL`` means pending."""

    seq = models.BigAutoField(primary_key=True)
    message_id = models.UUIDField(unique=True)
    type = models.CharField(max_length=200)
    payload = models.JSONField()
    headers = models.JSONField()
    created_at_ms = models.BigIntegerField()
    published_at_ms = models.BigIntegerField(null=True, blank=True)
    attempts = models.IntegerField(db_default=0)
    next_attempt_at_ms = models.BigIntegerField()
    dead_lettered_at_ms = models.BigIntegerField(null=True, blank=True)
    last_error = models.TextField(null=True, blank=True)
    dedup_key = models.CharField(max_length=200, null=True, blank=True)  # docs/scheduled.md, "Deduplicate by key"
    held_for = models.CharField(max_length=300, null=True, blank=True)  # docs/scheduled.md, "Deploys"

    class Meta:
        db_table = "outbox_messages"
        ordering = ("seq",)
        indexes = (
            models.Index(fields=["seq"], name="ix_outbox_pending",
                         # the library's predicate, in its order (Q(**kwargs) would sort the terms)
                         condition=Q(published_at_ms__isnull=True) & Q(dead_lettered_at_ms__isnull=True)),
            models.Index(fields=["published_at_ms"], name="ix_outbox_published",
                         condition=Q(published_at_ms__isnull=False)),
            models.Index(fields=["next_attempt_at_ms", "seq"], name="ix_outbox_due",
                         condition=Q(published_at_ms__isnull=True) & Q(dead_lettered_at_ms__isnull=True)),
            models.Index(fields=["seq"], name="ix_outbox_dead", condition=Q(dead_lettered_at_ms__isnull=False)),
            models.Index(fields=["held_for"], name="ix_outbox_held",
                         condition=Q(published_at_ms__isnull=True) & Q(dead_lettered_at_ms__isnull=True)
                         & Q(held_for__isnull=False)),
        )
        constraints = (
            models.UniqueConstraint(fields=["dedup_key"], name="ux_outbox_dedup",
                                    condition=Q(published_at_ms__isnull=True) & Q(dead_lettered_at_ms__isnull=True)
                                    & Q(dedup_key__isnull=False)),
        )

    def __str__(self) -> str:
        return f"{self.type} {self.message_id} (seq {self.seq})"


class InboxEntry(models.Model):  # type: ignore[misc]
    """(message_id, consumer) processed and committed with its effect. The primary key IS the guarantee."""

    pk = models.CompositePrimaryKey("message_id", "consumer")
    message_id = models.UUIDField()
    consumer = models.CharField(max_length=64)
    type = models.CharField(max_length=200)
    processed_at_ms = models.BigIntegerField()

    class Meta:
        db_table = "outbox_inbox"
        indexes = (models.Index(fields=["processed_at_ms"], name="ix_outbox_inbox_processed"),)

    def __str__(self) -> str:
        return f"{self.consumer} {self.message_id}"


class DeliveryAttempt(models.Model):  # type: ignore[misc]
    """Failed deliveries per (message, consumer), kept by the shared delivery core."""

    pk = models.CompositePrimaryKey("message_id", "consumer")
    message_id = models.UUIDField()
    consumer = models.CharField(max_length=64)
    deliveries = models.IntegerField()
    first_failed_at_ms = models.BigIntegerField()
    last_failed_at_ms = models.BigIntegerField()
    last_error = models.TextField()

    class Meta:
        db_table = "outbox_attempts"

    def __str__(self) -> str:
        return f"{self.consumer} {self.message_id}: {self.deliveries}"


class ConsumerDeadLetter(models.Model):  # type: ignore[misc]
    """A message a consumer gave up on, kept raw (``body``) so even malformed input is never lost."""

    id = models.BigAutoField(primary_key=True)
    consumer = models.CharField(max_length=64)
    message_id = models.CharField(max_length=64)
    type = models.CharField(max_length=200, null=True, blank=True)
    body = models.TextField()
    headers = models.JSONField()
    delivery_count = models.IntegerField()
    last_error = models.TextField()
    first_failed_at_ms = models.BigIntegerField()
    last_failed_at_ms = models.BigIntegerField()
    replayed_at_ms = models.BigIntegerField(null=True, blank=True)
    fingerprint = models.CharField(max_length=32, null=True, blank=True)

    class Meta:
        db_table = "outbox_dead_letters"
        indexes = (models.Index(fields=["consumer"], name="ix_outbox_dead_letters_consumer"),
                   models.Index(fields=["fingerprint", "id", "last_failed_at_ms"], name="ix_outbox_dead_letters_group",
                                condition=Q(replayed_at_ms__isnull=True)),
                   models.Index(fields=["message_id"], name="ix_outbox_dead_letters_message"))

    def __str__(self) -> str:
        return f"{self.consumer} {self.message_id}"

    @classmethod
    def check(cls, **kwargs: Any) -> list[Any]:
        """Django's E034 (index names <= 30 characters) is for Oracle; this index's name must equal the
        Alembic schema's, and PostgreSQL/SQLite allow it. Without this, ``manage.py migrate`` refuses to run."""
        return [e for e in super().check(**kwargs) if e.id != "models.E034"]


class ParkedMessage(models.Model):  # type: ignore[misc]
    """An event that arrived ahead of its entity's next version (per-entity ordering)."""

    pk = models.CompositePrimaryKey("message_id", "consumer")
    message_id = models.UUIDField()
    consumer = models.CharField(max_length=64)
    entity_key = models.CharField(max_length=200)
    entity_version = models.BigIntegerField()
    envelope = models.JSONField()
    parked_at_ms = models.BigIntegerField()

    class Meta:
        db_table = "outbox_parked"
        indexes = (models.Index(fields=["consumer", "entity_key", "entity_version"], name="ix_outbox_parked_entity"),)

    def __str__(self) -> str:
        return f"{self.consumer} {self.entity_key}@{self.entity_version}"


class EntityVersion(models.Model):  # type: ignore[misc]
    """The last version of an entity a consumer applied (per-entity ordering)."""

    pk = models.CompositePrimaryKey("consumer", "entity_key")
    consumer = models.CharField(max_length=64)
    entity_key = models.CharField(max_length=200)
    version = models.BigIntegerField()

    class Meta:
        db_table = "outbox_entity_versions"

    def __str__(self) -> str:
        return f"{self.consumer} {self.entity_key}@{self.version}"


class ConsumerCounter(models.Model):  # type: ignore[misc]
    """Monotonic per-consumer counters (e.g. duplicates absorbed), shared with the SQLAlchemy side.

    On Postgres a counter may be kept in several rows (stripes ``name#<n>``, so no increment waits for
    another transaction: celery_outbox/counters.py); ``total`` adds them up."""

    pk = models.CompositePrimaryKey("consumer", "name")
    consumer = models.CharField(max_length=64)
    name = models.CharField(max_length=64)
    value = models.BigIntegerField()

    class Meta:
        db_table = "outbox_counters"

    def __str__(self) -> str:
        return f"{self.consumer}.{self.name} = {self.value}"

    @classmethod
    def total(cls, consumer: str, name: str, *, using: str = "default") -> int:
        """Counter ``(consumer, name)``: the sum of its stripes (0 when it was never incremented)."""
        rows = cls.objects.using(using).filter(Q(name=name) | Q(name__startswith=stripe_prefix(name)), consumer=consumer)
        return fold((consumer, n, v) for n, v in rows.values_list("name", "value")).get(consumer, {}).get(name, 0)


class TaskReceipt(models.Model):  # type: ignore[misc]
    """A plain task enqueued through the outbox that a worker started: the reconciler's evidence."""

    task_id = models.UUIDField(primary_key=True)
    received_at_ms = models.BigIntegerField()

    class Meta:
        db_table = "outbox_task_receipts"
        indexes = (models.Index(fields=["received_at_ms"], name="ix_outbox_receipts_at"),)

    def __str__(self) -> str:
        return f"receipt {self.task_id}"


class WorkerRegistration(models.Model):  # type: ignore[misc]
    """A live worker's queues and task names (celery_outbox/workers.py): the relay's deploy hold."""

    id = models.UUIDField(primary_key=True)
    name = models.CharField(max_length=255)
    queues = models.JSONField()
    tasks = models.JSONField()
    started_at_ms = models.BigIntegerField()
    heartbeat_at_ms = models.BigIntegerField()

    class Meta:
        db_table = "outbox_workers"

    def __str__(self) -> str:
        return f"worker {self.name}"
