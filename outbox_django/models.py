"""Unmanaged Django models of the ``outbox`` and ``inbox`` tables created by Alembic migration 0001.

``managed = False``: Alembic owns the schema (one set of migrations for SQLAlchemy, the relay and
Django); tests/django/test_django_schema.py proves these fields equal what the migration creates.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q


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

    class Meta:
        managed = False
        db_table = "outbox"
        ordering = ("seq",)
        indexes = (
            models.Index(fields=["seq"], name="ix_outbox_pending",
                         # the migration's predicate, in its order (Q(**kwargs) would sort the terms)
                         condition=Q(published_at_ms__isnull=True) & Q(dead_lettered_at_ms__isnull=True)),
            models.Index(fields=["published_at_ms"], name="ix_outbox_published",
                         condition=Q(published_at_ms__isnull=False)),
        )

    def __str__(self) -> str:
        return f"{self.type} {self.message_id} (seq {self.seq})"


class InboxEntry(models.Model):  # type: ignore[misc]
    """(message_id, consumer) processed and committed with its effect. The primary key IS the guarantee."""

    pk = models.CompositePrimaryKey("message_id", "consumer")
    message_id = models.UUIDField()
    consumer = models.CharField(max_length=64)
    type = models.CharField(max_length=200)
    processed_at_ms = models.BigIntegerField(db_index=True)

    class Meta:
        managed = False
        db_table = "inbox"

    def __str__(self) -> str:
        return f"{self.consumer} {self.message_id}"


class ConsumerDeadLetter(models.Model):  # type: ignore[misc]
    """A message a consumer gave up on, kept raw (``body``) so even malformed input is never lost.

    The same table the SQLAlchemy consumers write, so ``outbox`` tooling lists and replays both.
    """

    id = models.BigAutoField(primary_key=True)
    consumer = models.CharField(max_length=64, db_index=True)
    message_id = models.CharField(max_length=64)
    type = models.CharField(max_length=200, null=True, blank=True)
    body = models.TextField()
    headers = models.JSONField()
    delivery_count = models.IntegerField()
    last_error = models.TextField()
    first_failed_at_ms = models.BigIntegerField()
    last_failed_at_ms = models.BigIntegerField()
    replayed_at_ms = models.BigIntegerField(null=True, blank=True)

    class Meta:
        managed = False
        db_table = "consumer_dead_letters"

    def __str__(self) -> str:
        return f"{self.consumer} {self.message_id}"


class ConsumerCounter(models.Model):  # type: ignore[misc]
    """Monotonic per-consumer counters (e.g. duplicates absorbed), shared with the SQLAlchemy side."""

    pk = models.CompositePrimaryKey("consumer", "name")
    consumer = models.CharField(max_length=64)
    name = models.CharField(max_length=64)
    value = models.BigIntegerField()

    class Meta:
        managed = False
        db_table = "consumer_counters"

    def __str__(self) -> str:
        return f"{self.consumer}.{self.name} = {self.value}"
