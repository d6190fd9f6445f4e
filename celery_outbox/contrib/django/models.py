"""Managed Django models of the library's tables (default prefix ``outbox_``), built from ``celery_outbox.schema``.

The tables are declared once, in schema.py (``define_tables``): each model here is made from its SQLAlchemy
table (columns, primary key, unique columns, indexes and their partial predicates), so the two cannot drift.
``manage.py migrate`` creates them with this app's migrations (incl. the Postgres NOTIFY trigger and the
autovacuum settings); tests/django/test_django_schema.py proves the result is the schema ``outbox db upgrade``
(Alembic) creates, on Postgres and SQLite, and that Django's autodetector sees nothing to migrate. A change to
the tables is a change to schema.py, an Alembic revision, and a Django migration ``makemigrations celery_outbox``
writes from these models (plus ``StampRevision``, 0004_schema_version). Use one chain or the other on a
database, never both.
"""

from __future__ import annotations

import re
from typing import Any

import sqlalchemy as sa
from django.db import models
from django.db.models import Q

from celery_outbox.counters import fold, stripe_prefix
from celery_outbox.schema import Tables, define_tables

_TERM = re.compile(r"^\s*(\w+)\s+IS\s+(NOT\s+)?NULL\s*$", re.IGNORECASE)


def condition(sql: str) -> Q:
    """A partial index's predicate from schema.py as a Django ``Q``, its terms in their order (``Q(**kwargs)``
    would sort them). Only conjunctions of ``column IS [NOT] NULL`` are the library's: anything else is refused
    here, at import, rather than translated wrong."""
    q = Q()
    for term in re.split(r"\s+AND\s+", sql.strip(), flags=re.IGNORECASE):
        match = _TERM.match(term)
        if match is None:
            raise ValueError(f"predicate term {term!r} is not 'column IS [NOT] NULL'")
        q &= Q(**{f"{match.group(1)}__isnull": match.group(2) is None})
    return q


def field(column: sa.Column[Any], *, single_key: bool) -> Any:
    """The Django field of one column. ``single_key``: the column is the table's whole primary key."""
    type_ = column.type
    if single_key and column.identity is not None:
        return models.BigAutoField(primary_key=True)
    kwargs: dict[str, Any] = {}
    if single_key:
        kwargs["primary_key"] = True
    elif column.unique:
        kwargs["unique"] = True
    if column.nullable and not column.primary_key:
        kwargs.update(null=True, blank=True)
    if column.server_default is not None:
        kwargs["db_default"] = int(str(getattr(column.server_default, "arg", "")))
    if isinstance(type_, sa.Uuid):
        return models.UUIDField(**kwargs)
    if isinstance(type_, sa.JSON):
        return models.JSONField(**kwargs)
    if isinstance(type_, sa.Text):
        return models.TextField(**kwargs)
    if isinstance(type_, sa.String):
        return models.CharField(max_length=type_.length, **kwargs)
    if isinstance(type_, sa.BigInteger):
        return models.BigIntegerField(**kwargs)
    if isinstance(type_, sa.Integer):
        return models.IntegerField(**kwargs)
    raise TypeError(f"no Django field for {column.table.name}.{column.name} ({type_!r})")


def model(tables: Tables, cls: type[Any], behaviour: type[Any], **meta: Any) -> Any:
    """The managed model of one mapped class of ``tables``: named as that class, ``behaviour``'s methods, and
    ``meta`` added to its ``Meta`` (what only Django has, e.g. ``ordering``)."""
    table = tables.table(cls)
    key = [c.name for c in table.primary_key.columns]
    attrs: dict[str, Any] = {"__module__": __name__, "__qualname__": cls.__name__, "__doc__": behaviour.__doc__}
    if len(key) > 1:
        attrs["pk"] = models.CompositePrimaryKey(*key)
    for column in table.columns:
        attrs[column.name] = field(column, single_key=key == [column.name])
    where = {ix: ix.dialect_options["postgresql"].get("where") for ix in table.indexes}
    attrs["Meta"] = type("Meta", (), {
        "db_table": table.name,
        "indexes": tuple(models.Index(fields=[c.name for c in ix.columns], name=ix.name,
                                      **({"condition": condition(str(where[ix]))} if where[ix] is not None else {}))
                         for ix in table.indexes if not ix.unique),
        "constraints": tuple(models.UniqueConstraint(fields=[c.name for c in ix.columns], name=ix.name,
                                                     **({"condition": condition(str(where[ix]))}
                                                        if where[ix] is not None else {}))
                             for ix in table.indexes if ix.unique),
        **meta,
    })
    return type(cls.__name__, (behaviour, models.Model), attrs)


class _Model:
    """What every model here adds to its columns."""

    @classmethod
    def check(cls, **kwargs: Any) -> list[Any]:
        """Django's E034 (index names <= 30 characters) is for Oracle; the index names must equal the Alembic
        schema's (ix_outbox_dead_letters_group), and PostgreSQL/SQLite allow them. Without this, ``manage.py
        migrate`` refuses to run."""
        return [e for e in super().check(**kwargs) if e.id != "models.E034"]  # type: ignore[misc]


class _OutboxMessage(_Model):
    """One event waiting for (or past) the relay. ``published_at_ms IS NULL`` means pending."""

    def __str__(self) -> str:
        row: Any = self
        return f"{row.type} {row.message_id} (seq {row.seq})"


class _ByConsumer(_Model):
    """An inbox entry, a delivery attempt, a dead letter: per consumer and message."""

    def __str__(self) -> str:
        row: Any = self
        return f"{row.consumer} {row.message_id}"


class _DeliveryAttempt(_Model):
    """Failed deliveries per (message, consumer), kept by the shared delivery core."""

    def __str__(self) -> str:
        row: Any = self
        return f"{row.consumer} {row.message_id}: {row.deliveries}"


class _ParkedMessage(_Model):
    """An event that arrived ahead of its entity's next version (per-entity ordering)."""

    def __str__(self) -> str:
        row: Any = self
        return f"{row.consumer} {row.entity_key}@{row.entity_version}"


class _EntityVersion(_Model):
    """The last version of an entity a consumer applied (per-entity ordering)."""

    def __str__(self) -> str:
        row: Any = self
        return f"{row.consumer} {row.entity_key}@{row.version}"


class _ConsumerCounter(_Model):
    """Monotonic per-consumer counters (e.g. duplicates absorbed), shared with the SQLAlchemy side.

    On Postgres a counter may be kept in several rows (stripes ``name#<n>``, so no increment waits for
    another transaction: celery_outbox/counters.py); ``total`` adds them up."""

    def __str__(self) -> str:
        row: Any = self
        return f"{row.consumer}.{row.name} = {row.value}"

    @classmethod
    def total(cls, consumer: str, name: str, *, using: str = "default") -> int:
        """Counter ``(consumer, name)``: the sum of its stripes (0 when it was never incremented)."""
        objects: Any = getattr(cls, "objects")  # noqa: B009 - the manager Django adds to the model
        rows = objects.using(using).filter(Q(name=name) | Q(name__startswith=stripe_prefix(name)), consumer=consumer)
        return fold((consumer, n, v) for n, v in rows.values_list("name", "value")).get(consumer, {}).get(name, 0)


class _TaskReceipt(_Model):
    """A plain task enqueued through the outbox that a worker started: the reconciler's evidence."""

    def __str__(self) -> str:
        return f"receipt {getattr(self, 'task_id')}"  # noqa: B009


class _WorkerRegistration(_Model):
    """A live worker's queues and task names (celery_outbox/workers.py): the relay's deploy hold."""

    def __str__(self) -> str:
        return f"worker {getattr(self, 'name')}"  # noqa: B009


_tables = define_tables(sa.MetaData())

OutboxMessage = model(_tables, _tables.outbox, _OutboxMessage, ordering=("seq",))
InboxEntry = model(_tables, _tables.inbox, _ByConsumer)
DeliveryAttempt = model(_tables, _tables.attempts, _DeliveryAttempt)
ConsumerDeadLetter = model(_tables, _tables.dead_letters, _ByConsumer)
ParkedMessage = model(_tables, _tables.parked, _ParkedMessage)
EntityVersion = model(_tables, _tables.entity_versions, _EntityVersion)
ConsumerCounter = model(_tables, _tables.counters, _ConsumerCounter)
TaskReceipt = model(_tables, _tables.receipts, _TaskReceipt)
WorkerRegistration = model(_tables, _tables.workers, _WorkerRegistration)
