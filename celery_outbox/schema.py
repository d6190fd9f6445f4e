"""The library's tables, defined into any ``MetaData`` under a name prefix (default ``outbox_``).

``define_tables(metadata, prefix=...)`` maps fresh ORM classes onto the caller's metadata, so an
application's own Alembic autogenerate sees them beside its models, and two prefixes can live in
one database. The column sets are the mixins below (typed, shared by every prefix); every core
function takes the resulting ``Tables`` instead of importing a fixed model. See docs/schema.md.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import DeclarativeBase, Mapped, MappedColumn, mapped_column, registry

from celery_outbox.entity_headers import ENTITY_KEY_MAX_CHARS
from celery_outbox.errors import ConfigError


class TextJSON(sa.JSON):
    """JSON in a TEXT column on SQLite, as Django's JSONField stores it: TEXT affinity keeps a JSON document
    the text it was (a column declared JSON has NUMERIC affinity), and ``json_valid`` CHECKs it (``mapped``)."""

    cache_ok = True


@compiles(TextJSON, "sqlite")
def _text_json(type_: TextJSON, compiler: Any, **kw: Any) -> str:
    return "TEXT"


JSONType = sa.JSON().with_variant(JSONB(), "postgresql").with_variant(TextJSON(), "sqlite")
# seq is the relay's order: a bigint identity on Postgres, SQLite's rowid alias there (AUTOINCREMENT: ``mapped``).
SeqType = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

PENDING_SQL = "published_at_ms IS NULL AND dead_lettered_at_ms IS NULL"
DEAD_SQL = "dead_lettered_at_ms IS NOT NULL"
DEDUP_SQL = f"{PENDING_SQL} AND dedup_key IS NOT NULL"
HELD_SQL = f"{PENDING_SQL} AND held_for IS NOT NULL"
UNREPLAYED_SQL = "replayed_at_ms IS NULL"
DEFAULT_PREFIX = "outbox_"
_PREFIX = re.compile(r"^[a-z][a-z0-9_]{0,29}$")


class _Row:
    """Typing only: mapped classes take their columns as keyword arguments."""

    if TYPE_CHECKING:
        def __init__(self, **values: Any) -> None: ...


class OutboxRow(_Row):
    """One event waiting for (or past) the relay. ``published_at_ms IS NULL`` means pending."""

    seq: Mapped[int] = mapped_column(SeqType, sa.Identity(), primary_key=True)
    message_id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, unique=True, default=uuid.uuid4)
    type: Mapped[str] = mapped_column(sa.String(200))
    payload: Mapped[Any] = mapped_column(JSONType)
    headers: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    created_at_ms: Mapped[int] = mapped_column(sa.BigInteger)
    published_at_ms: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)
    attempts: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    next_attempt_at_ms: Mapped[int] = mapped_column(sa.BigInteger)
    dead_lettered_at_ms: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)
    last_error: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    # At most one pending row per key (``ux_<prefix>dedup``): a task enqueued with a dedup key
    # (docs/scheduled.md, "Deduplicate by key"); NULL for everything else, and once dead-lettered.
    dedup_key: Mapped[str | None] = mapped_column(sa.String(200), nullable=True)
    # The task row waits for a worker that can run it (a rolling deploy, docs/scheduled.md "Deploys"):
    # what it waits for, e.g. "billing.charge v2 on queue billing"; NULL for everything else.
    held_for: Mapped[str | None] = mapped_column(sa.String(300), nullable=True)


class InboxRow(_Row):
    """(message_id, consumer) seen and committed with its effect. The primary key IS the guarantee."""

    message_id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, primary_key=True)
    consumer: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    type: Mapped[str] = mapped_column(sa.String(200))
    processed_at_ms: Mapped[int] = mapped_column(sa.BigInteger)


class AttemptRow(_Row):
    """Failed deliveries per (message, consumer), counted in the database so redeliveries after a
    killed worker count too (Celery's ``request.retries`` only counts ``self.retry``)."""

    message_id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, primary_key=True)
    consumer: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    deliveries: Mapped[int] = mapped_column(sa.Integer, default=0)
    first_failed_at_ms: Mapped[int] = mapped_column(sa.BigInteger)
    last_failed_at_ms: Mapped[int] = mapped_column(sa.BigInteger)
    last_error: Mapped[str] = mapped_column(sa.Text)


class DeadLetterRow(_Row):
    """A message a consumer gave up on. Kept raw (``body``) so even malformed input is never lost."""

    id: Mapped[int] = mapped_column(SeqType, sa.Identity(), primary_key=True)
    consumer: Mapped[str] = mapped_column(sa.String(64))
    message_id: Mapped[str] = mapped_column(sa.String(64))
    type: Mapped[str | None] = mapped_column(sa.String(200), nullable=True)
    body: Mapped[str] = mapped_column(sa.Text)
    headers: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    delivery_count: Mapped[int] = mapped_column(sa.Integer)
    last_error: Mapped[str] = mapped_column(sa.Text)
    first_failed_at_ms: Mapped[int] = mapped_column(sa.BigInteger)
    last_failed_at_ms: Mapped[int] = mapped_column(sa.BigInteger)
    replayed_at_ms: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)
    # Which failure this is (inbox/fingerprints.py): dead letters are listed, replayed and purged by group.
    fingerprint: Mapped[str | None] = mapped_column(sa.String(32), nullable=True)
    # The Celery task id of the delivery that gave up (NULL when unknown): a replay runs under it, so the
    # task's page in Flower goes from FAILURE to the replay's outcome (docs/operations.md, "Flower").
    task_id: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)


class ParkedRow(_Row):
    """An event that arrived ahead of its entity's next version, waiting for the gap to fill."""

    message_id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, primary_key=True)
    consumer: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    entity_key: Mapped[str] = mapped_column(sa.String(ENTITY_KEY_MAX_CHARS))
    entity_version: Mapped[int] = mapped_column(sa.BigInteger)
    envelope: Mapped[dict[str, Any]] = mapped_column(JSONType)
    parked_at_ms: Mapped[int] = mapped_column(sa.BigInteger)


class EntityVersionRow(_Row):
    """The last version of an entity a consumer applied (per-entity ordering, opt-in)."""

    consumer: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    entity_key: Mapped[str] = mapped_column(sa.String(ENTITY_KEY_MAX_CHARS), primary_key=True)
    version: Mapped[int] = mapped_column(sa.BigInteger)
    # Whether the entity may have parked messages: 0 says it has none, so a delivery that advances it does not
    # read them (inbox/ordering.py); set by the transaction that parks one (and by ``parked_trigger``), cleared by one
    # that finds none left.
    # The default (1: read them) is what rows written before the column, or without it, get.
    parked: Mapped[int] = mapped_column(sa.Integer, server_default="1")


class CounterRow(_Row):
    """Monotonic counters kept by the transaction that does the counted work (metrics, stats)."""

    consumer: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    value: Mapped[int] = mapped_column(sa.BigInteger, default=0)


class TaskReceiptRow(_Row):
    """A plain task enqueued through the outbox that a worker started (celery_outbox/celery/receipts.py).

    A plain ``@app.task`` has no inbox row, so this is the reconciler's only evidence that its message
    reached a worker; a published task row without one is sent again (relay/reconcile.py)."""

    task_id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, primary_key=True)
    received_at_ms: Mapped[int] = mapped_column(sa.BigInteger)


class WorkerRow(_Row):
    """A live worker's registration (celery_outbox/workers.py): the queues it consumes and the task names
    (with their versions) it runs, refreshed by its heartbeat; the relay holds task rows no live worker of
    their queue can run."""

    id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, primary_key=True)  # one per worker start
    name: Mapped[str] = mapped_column(sa.String(255))  # its node name, for people
    queues: Mapped[list[str]] = mapped_column(JSONType)
    tasks: Mapped[dict[str, int]] = mapped_column(JSONType)
    started_at_ms: Mapped[int] = mapped_column(sa.BigInteger)
    heartbeat_at_ms: Mapped[int] = mapped_column(sa.BigInteger)


@dataclass(frozen=True, kw_only=True)
class Tables:
    """The mapped classes of one prefix. Pass it to core functions; ``names()`` lists the tables."""

    prefix: str
    metadata: sa.MetaData
    outbox: type[OutboxRow]
    inbox: type[InboxRow]
    attempts: type[AttemptRow]
    dead_letters: type[DeadLetterRow]
    parked: type[ParkedRow]
    entity_versions: type[EntityVersionRow]
    counters: type[CounterRow]
    receipts: type[TaskReceiptRow]
    workers: type[WorkerRow]

    @property
    def notify_channel(self) -> str:
        """The Postgres NOTIFY channel a new outbox row fires (the standalone relay LISTENs)."""
        return f"{self.prefix}pending"

    @property
    def version_table(self) -> str:
        """Alembic's version table for ``outbox db upgrade``: never the application's own."""
        return f"{self.prefix}schema_version"

    def table(self, cls: type[Any]) -> sa.Table:
        return cast(sa.Table, cls.__table__)

    def names(self) -> tuple[str, ...]:
        return tuple(self.table(c).name for c in (self.outbox, self.inbox, self.attempts, self.dead_letters,
                                                   self.parked, self.entity_versions, self.counters,
                                                   self.receipts, self.workers))


@dataclass(frozen=True, kw_only=True)
class NotifyTrigger:
    """The NOTIFY trigger (and its function, of the same name) that wakes a standalone relay on Postgres, as
    migrations co0001 (Alembic) and 0002_notify_trigger (Django) create it: what ``outbox db check`` expects."""

    name: str
    table: str
    channel: str

    @property
    def body(self) -> str:
        return f"BEGIN PERFORM pg_notify('{self.channel}', ''); RETURN NULL; END"

    @property
    def definition(self) -> str:
        return (f"CREATE TRIGGER {self.name} AFTER INSERT ON {self.table} FOR EACH STATEMENT "
                f"EXECUTE FUNCTION {self.name}()")


def notify_trigger(tables: Tables) -> NotifyTrigger:
    return NotifyTrigger(name=f"{tables.prefix}notify", table=tables.table(tables.outbox).name,
                         channel=tables.notify_channel)


@dataclass(frozen=True, kw_only=True)
class ParkedTrigger:
    """The trigger (on Postgres with its function, of the same name) that sets an entity's ``parked`` marker when
    a message of the entity is parked, as migrations co0010 (Alembic) and 0012_entity_parked_marker (Django)
    create it: what ``outbox db check`` expects. The delivery that parks sets the marker itself
    (inbox/ordering.py); the trigger covers a worker of the release before the marker, which parks without
    setting it, beside new workers that clear it (a rolling deploy). It runs as the inserting role, which
    updates the entity's row anyway. On Postgres it names the entity table in the parked table's own schema
    (``TG_TABLE_SCHEMA``), not through the inserting session's search_path.

    A later migration that rebuilds either table on SQLite (Alembic's batch mode, Django's table remake) drops it
    first and creates it after: a rebuilt parked table loses it, and the rename that ends a rebuild of the entity
    table fails while it exists ("error in trigger ... no such table"); the upgrade tests' ``outbox db check``
    names a lost one."""

    name: str
    parked: str
    entity_versions: str

    def _update(self, consumer: str, key: str) -> str:
        return f"SET parked = 1 WHERE consumer = {consumer} AND entity_key = {key} AND parked <> 1"

    @property
    def body(self) -> str:
        """The Postgres function's body."""
        return (f"BEGIN EXECUTE 'UPDATE ' || quote_ident(TG_TABLE_SCHEMA) || '.{self.entity_versions} "
                f"{self._update('$1', '$2')}' USING NEW.consumer, NEW.entity_key; RETURN NULL; END")

    @property
    def definition(self) -> str:
        """Postgres' CREATE TRIGGER."""
        return (f"CREATE TRIGGER {self.name} AFTER INSERT ON {self.parked} FOR EACH ROW "
                f"EXECUTE FUNCTION {self.name}()")

    @property
    def sqlite(self) -> str:
        """SQLite's CREATE TRIGGER (its body's table is the trigger's database's)."""
        return (f"CREATE TRIGGER {self.name} AFTER INSERT ON {self.parked} FOR EACH ROW "
                f"BEGIN UPDATE {self.entity_versions} {self._update('NEW.consumer', 'NEW.entity_key')}; END")

    def create(self, dialect: str) -> list[str]:
        """The statements that create it on ``dialect`` (a dialect's name: "postgresql", "sqlite")."""
        if dialect == "postgresql":
            return [f"CREATE OR REPLACE FUNCTION {self.name}() RETURNS trigger AS $$ {self.body} $$ "
                    "LANGUAGE plpgsql", self.definition]
        return [self.sqlite] if dialect == "sqlite" else []

    def drop(self, dialect: str) -> list[str]:
        if dialect == "postgresql":
            return [f"DROP TRIGGER IF EXISTS {self.name} ON {self.parked}", f"DROP FUNCTION IF EXISTS {self.name}()"]
        return [f"DROP TRIGGER IF EXISTS {self.name}"] if dialect == "sqlite" else []


def parked_trigger(tables: Tables) -> ParkedTrigger:
    return ParkedTrigger(name=f"{tables.prefix}parked_marker", parked=tables.table(tables.parked).name,
                         entity_versions=tables.table(tables.entity_versions).name)


T = TypeVar("T")


def check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not _PREFIX.match(prefix):
        raise ConfigError(
            f"table prefix {prefix!r} must be lower-case letters, digits and '_', start with a letter, "
            "at most 30 characters (e.g. 'outbox_')"
        )
    return prefix


def define_tables(metadata: sa.MetaData | None = None, *, prefix: str = DEFAULT_PREFIX) -> Tables:
    """Map the outbox, inbox and dead-letter tables into ``metadata`` (a new one if None)."""
    check_prefix(prefix)
    md = metadata if metadata is not None else sa.MetaData()
    taken = [n for n in (f"{prefix}messages", f"{prefix}inbox") if n in md.tables]
    if taken:
        raise ConfigError(f"tables {', '.join(taken)} are already defined in this MetaData; call define_tables "
                          "once per metadata and prefix, and pass the Tables it returns around")

    class Base(DeclarativeBase):
        registry = registry(metadata=md)

    def mapped(name: str, mixin: type[T], table: str, args: tuple[Any, ...] = ()) -> type[T]:
        # SQLite: a table keyed by an identity is AUTOINCREMENT (a deleted row's key is never given again,
        # as Django's AutoField has it)
        auto = any(isinstance(c, MappedColumn) and c.column.primary_key and c.column.identity is not None
                   for c in vars(mixin).values())
        attrs: dict[str, Any] = {"__tablename__": f"{prefix}{table}",
                                 "__table_args__": (*args, {"sqlite_autoincrement": True} if auto else {})}
        cls = cast(type[T], type(name, (mixin, Base), attrs))
        tbl = cast(sa.Table, cast(Any, cls).__table__)
        for col in tbl.columns:
            if isinstance(col.type, sa.JSON):  # SQLite only: the text a TextJSON column holds is JSON
                # named, so that Alembic's batch mode keeps it when it rebuilds the table
                tbl.append_constraint(sa.CheckConstraint(f'JSON_VALID("{col.name}") OR "{col.name}" IS NULL',
                                                         name=f"ck_{tbl.name}_{col.name}_json")
                                      .ddl_if(dialect="sqlite"))
        return cls

    pending = sa.text(PENDING_SQL)
    published = sa.text("published_at_ms IS NOT NULL")
    dead = sa.text(DEAD_SQL)
    dedup = sa.text(DEDUP_SQL)
    unreplayed = sa.text(UNREPLAYED_SQL)
    held = sa.text(HELD_SQL)
    return Tables(
        prefix=prefix, metadata=md,
        outbox=mapped("OutboxMessage", OutboxRow, "messages", (
            # Keeps the relay's query O(batch) however much published history the table holds.
            sa.Index(f"ix_{prefix}pending", "seq", postgresql_where=pending, sqlite_where=pending),
            # The relay's claim: pending rows by due time, so rows held for later (a countdown, a backoff)
            # are never read by a batch before they are due (docs/scheduled.md).
            sa.Index(f"ix_{prefix}due", "next_attempt_at_ms", "seq", postgresql_where=pending, sqlite_where=pending),
            # Retention prunes published rows oldest first without scanning pending ones.
            sa.Index(f"ix_{prefix}published", "published_at_ms", postgresql_where=published,
                     sqlite_where=published),
            # The relay's dead letters without a scan of the history (stats, groups); holds only dead rows.
            sa.Index(f"ix_{prefix}dead", "seq", postgresql_where=dead, sqlite_where=dead),
            # At most one pending task per dedup key, also between concurrent transactions: the second
            # insert waits for the first to commit, then conflicts (celery/dedup.py).
            sa.Index(f"ux_{prefix}dedup", "dedup_key", unique=True, postgresql_where=dedup, sqlite_where=dedup),
            # 'outbox stats': task rows waiting for a worker that runs them, grouped, without a scan.
            sa.Index(f"ix_{prefix}held", "held_for", postgresql_where=held, sqlite_where=held),
        )),
        inbox=mapped("InboxEntry", InboxRow, "inbox", (
            sa.Index(f"ix_{prefix}inbox_processed", "processed_at_ms"),)),
        attempts=mapped("DeliveryAttempt", AttemptRow, "attempts"),
        dead_letters=mapped("ConsumerDeadLetter", DeadLetterRow, "dead_letters", (
            sa.Index(f"ix_{prefix}dead_letters_consumer", "consumer"),
            # 'outbox dead-letters groups' (an index-only scan) and a group's replay or purge in id order.
            sa.Index(f"ix_{prefix}dead_letters_group", "fingerprint", "id", "last_failed_at_ms",
                     postgresql_where=unreplayed, sqlite_where=unreplayed),
            # 'outbox trace': a message's dead letters by its id.
            sa.Index(f"ix_{prefix}dead_letters_message", "message_id"),
        )),
        parked=mapped("ParkedMessage", ParkedRow, "parked", (
            sa.Index(f"ix_{prefix}parked_entity", "consumer", "entity_key", "entity_version"),)),
        entity_versions=mapped("EntityVersion", EntityVersionRow, "entity_versions"),
        counters=mapped("ConsumerCounter", CounterRow, "counters"),
        receipts=mapped("TaskReceipt", TaskReceiptRow, "task_receipts", (
            # Retention prunes receipts oldest first, as it prunes the inbox.
            sa.Index(f"ix_{prefix}receipts_at", "received_at_ms"),)),
        workers=mapped("WorkerRegistration", WorkerRow, "workers"),
    )
