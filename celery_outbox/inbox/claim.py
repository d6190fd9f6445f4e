"""The inbox key: claiming ``(message_id, consumer)`` inside the effect's transaction.

Shared by ``handle`` (the plain path) and ``ordering`` (the per-entity path), so neither imports the other.

The claim is ONE statement, ``INSERT ... ON CONFLICT DO NOTHING``, whose row count says whether this
delivery owns the key: 1 = claimed (run the effect), 0 = the key is already there (a duplicate).
No read comes first and no unique violation aborts the transaction. The composite primary key is
still the guarantee: on Postgres an insert of a key that a concurrent, uncommitted transaction has
just inserted waits for that transaction to end, then inserts nothing if it committed (or the row if
it rolled back); SQLite serialises writers on its database lock (``BEGIN IMMEDIATE``, db.py). See
docs/design.md, rule 6.

On Postgres through a libpq driver (psycopg 2 or 3) on a pooled connection, the statements that run on
every delivery (the claim; ordering's version row) go to the driver as SQL text compiled once per
connection (``driver_sql``): the same statement and round trip, without SQLAlchemy's per-execution
cache-key, compile-cache and type-processing work (bench/consumer_claim.py; docs/benchmarks.md,
"Consumers at the statements the guarantee needs").
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from celery_outbox.clock import SystemClock
from celery_outbox.db import LIBPQ_DRIVERS, wrap_driver_errors
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from celery_outbox.sql import insert_if_absent, key_columns, translates_schema

Handler = Callable[[Session, Envelope], None]
"""The effect: write with the given session, never commit (the inbox commits)."""

Prepare = Callable[[Session, Envelope], None]
"""An external effect with an idempotency key, run before the inbox transaction opens."""

NOW_KEY = "outbox_consumer_now_ms"
_CLAIM_COLUMNS = ("message_id", "consumer", "type", "processed_at_ms")
_DRIVER_SQL_KEY = "celery_outbox.driver_sql"
# psycopg 3 reports -1 for an INSERT's row count unless SQLAlchemy is asked to keep it (sql.insert_for)
_KEEP_ROWCOUNT: Mapping[str, Any] = MappingProxyType({"preserve_rowcount": True})


class CrashSite(Protocol):
    """What ``handle`` needs of ``celery_outbox.crashpoints.CrashPoints`` (tests pass a raising fake)."""

    def reached(self, name: str) -> None: ...


class DuplicateDelivery(Exception):
    """Internal signal: the inbox (or the parking lot) already holds this key. Never escapes handle()."""


def effect_now_ms(session: Session) -> int:
    """The instant of the delivery being handled, for handlers that stamp their rows."""
    value = session.info.get(NOW_KEY)
    return int(value) if value is not None else SystemClock().now_ms()


def already_seen(session: Session, message_id: uuid.UUID, consumer: str, *, tables: Tables) -> bool:
    """A plain read of the inbox key. Correctness never depends on it: ``handle`` uses it only before a
    ``prepare`` step (to spare the external call), ``delivery`` on its rare worker-lost path."""
    stmt = sa.select(sa.literal(1)).where(tables.inbox.message_id == message_id, tables.inbox.consumer == consumer)
    with wrap_driver_errors(f"inbox lookup for {consumer}"):
        return session.execute(stmt).first() is not None


def driver_sql(connection: sa.Connection, key: tuple[Any, ...], build: Callable[[], Any]) -> str | None:
    """The SQL text of ``build()``'s statement for ``connection``'s dialect, compiled once per pooled
    connection and kept in its ``info``; None when the statement should run through SQLAlchemy instead:
    not Postgres through a libpq driver, a connection that does not outlive its checkout (``NullPool``,
    where the text would be compiled on every delivery), or one whose statements SQLAlchemy rewrites as it
    runs them (a ``schema_translate_map``). Run the text with ``connection.exec_driver_sql`` and parameters
    the driver adapts as they are (a UUID as its string)."""
    dialect = connection.dialect
    if dialect.name != "postgresql" or dialect.driver not in LIBPQ_DRIVERS or isinstance(connection.engine.pool,
                                                                                        NullPool):
        return None
    if translates_schema(connection):
        return None
    cache: dict[tuple[Any, ...], str] = connection.info.setdefault(_DRIVER_SQL_KEY, {})
    sql = cache.get(key)
    if sql is None:
        sql = cache[key] = str(build().compile(dialect=dialect))
    return sql


def execute_driver_sql(connection: sa.Connection, sql: str, params: Mapping[str, Any]) -> sa.CursorResult[Any]:
    """Run ``driver_sql``'s text with ``params`` (its bind names), the row count kept."""
    return connection.exec_driver_sql(sql, dict(params), execution_options=_KEEP_ROWCOUNT)


def insert_values(table: sa.Table, columns: tuple[str, ...]) -> Any:
    """``INSERT INTO table (columns) VALUES (:column, ...)`` for Postgres (for ``driver_sql``)."""
    from sqlalchemy.dialects import postgresql

    return postgresql.insert(table).values({c: sa.bindparam(c) for c in columns})


def claim_if_absent(session: Session, envelope: Envelope, *, tables: Tables, consumer: str, now_ms: int) -> bool:
    """Claim the inbox key inside the caller's transaction: True when this call inserted the row,
    False when the key is already there (a duplicate; nothing was written, the transaction is intact)."""
    table = tables.table(tables.inbox)
    with wrap_driver_errors(f"inbox insert for {consumer}"):
        connection = session.connection()
        sql = driver_sql(connection, ("claim", table), lambda: (
            insert_values(table, _CLAIM_COLUMNS).on_conflict_do_nothing(index_elements=list(key_columns(table)))))
        if sql is not None:
            return execute_driver_sql(connection, sql, {
                "message_id": str(envelope.message_id), "consumer": consumer, "type": envelope.type,
                "processed_at_ms": now_ms}).rowcount == 1
        return insert_if_absent(session, table, key_columns(table), {
            "message_id": envelope.message_id, "consumer": consumer, "type": envelope.type, "processed_at_ms": now_ms,
        })


def claim(session: Session, envelope: Envelope, *, tables: Tables, consumer: str, now_ms: int) -> None:
    """``claim_if_absent`` that raises ``DuplicateDelivery`` when the key is already there."""
    if not claim_if_absent(session, envelope, tables=tables, consumer=consumer, now_ms=now_ms):
        raise DuplicateDelivery(f"{envelope.message_id}/{consumer}")


@contextmanager
def undone_on_error(session: Session) -> Iterator[None]:
    """Around a delivery's (or a batch's) transaction: any exception rolls it back, so neither the effect
    nor an inbox row is left, and propagates; the delivery's instant (``NOW_KEY``) never outlives it."""
    try:
        yield
    except BaseException:
        session.rollback()
        raise
    finally:
        session.info.pop(NOW_KEY, None)


def commit_effect(session: Session, crash: CrashSite, what: str) -> None:
    """Commit the effect with its inbox rows; the ``consumer_before_commit`` crash point stands just before."""
    session.flush()
    crash.reached("consumer_before_commit")
    with wrap_driver_errors(what):
        session.commit()
