"""Dialect-aware upsert: one statement on SQLite and Postgres, so concurrent writers never race a
SELECT-then-INSERT; and the per-connection statement cache of the hot paths."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import Insert

from celery_outbox.db import is_postgres

_STATEMENTS_KEY = "celery_outbox.statements"
S = TypeVar("S")


def insert_for(session: Session, target: type[Any] | sa.Table) -> Any:
    """``INSERT`` into a mapped class or a table with ``on_conflict_do_*`` for the session's dialect
    (both share the API).

    ``preserve_rowcount``: callers read the row count (0 = the row was there: a duplicate). psycopg 3
    reports -1 for an INSERT unless asked, which would read every inbox claim as a duplicate and skip
    its effect (tests/unit/test_inbox_claim.py, every driver)."""
    dialect = postgresql if is_postgres(session) else sqlite
    return dialect.insert(target).execution_options(preserve_rowcount=True)


def translates_schema(connection: sa.Connection) -> bool:
    """Whether SQLAlchemy rewrites the statements ``connection`` runs (a ``schema_translate_map``): SQL text
    compiled once and run as it is would bypass that, so such a connection runs statements through SQLAlchemy."""
    return bool(connection.get_execution_options().get("schema_translate_map"))


def statement(session: Session, key: tuple[Any, ...], build: Callable[[], S]) -> tuple[sa.Connection, S]:
    """The session's connection (in its transaction) and the statement ``build()`` made for ``key``,
    built once per pooled connection and kept in that connection's ``info`` (no module-level state).

    For statements with ``bindparam`` placeholders that run on every delivery: building a statement
    and its cache key each time costs more CPU than executing it (bench/consumer_overhead.py).
    """
    connection = session.connection()
    statements: dict[tuple[Any, ...], Any] = connection.info.setdefault(_STATEMENTS_KEY, {})
    stmt = statements.get(key)
    if stmt is None:
        stmt = statements[key] = build()
    return connection, cast(S, stmt)


def key_columns(table: sa.Table) -> tuple[str, ...]:
    """The names of ``table``'s primary key columns, in order: the conflict target of an insert-if-absent
    (the inbox's ``(message_id, consumer)`` is its primary key, schema.py ``InboxRow``)."""
    return tuple(column.name for column in table.primary_key.columns)


def insert_if_absent(session: Session, table: sa.Table, keys: tuple[str, ...], values: dict[str, Any]) -> bool:
    """``INSERT ... ON CONFLICT (keys) DO NOTHING`` of one row, in the session's transaction; True when
    it inserted it.

    The hot path of every delivery (bench/consumer_overhead.py), so it skips what it does not need:
    a Core statement (no ORM unit of work) from ``statement``'s cache, the values passed as execute
    parameters (no bound parameter objects built per call).
    """
    connection, stmt = statement(session, ("insert_if_absent", table, keys),
                                 lambda: insert_for(session, table).on_conflict_do_nothing(index_elements=list(keys)))
    result = connection.execute(stmt, values)
    return bool(result.rowcount == 1)


def upsert(session: Session, model: type[Any], values: Mapping[str, Any], *, keys: Sequence[str],
           update: Mapping[str, Any] | None = None) -> Insert:
    """``INSERT ... ON CONFLICT (keys) DO UPDATE SET update`` (or ``DO NOTHING`` without ``update``)."""
    stmt = insert_for(session, model).values(**values)
    if update:
        result: Insert = stmt.on_conflict_do_update(index_elements=list(keys), set_=dict(update))
    else:
        result = stmt.on_conflict_do_nothing(index_elements=list(keys))
    return result
