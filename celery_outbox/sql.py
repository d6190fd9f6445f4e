"""Dialect-aware upsert: one statement on SQLite and Postgres, so concurrent writers never race a
SELECT-then-INSERT."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import Insert

from celery_outbox.db import is_postgres


def insert_for(session: Session, model: type[Any]) -> Any:
    """``INSERT`` with ``on_conflict_do_*`` for the session's dialect (both share the API)."""
    dialect = postgresql if is_postgres(session) else sqlite
    return dialect.insert(model)


def upsert(session: Session, model: type[Any], values: Mapping[str, Any], *, keys: Sequence[str],
           update: Mapping[str, Any] | None = None) -> Insert:
    """``INSERT ... ON CONFLICT (keys) DO UPDATE SET update`` (or ``DO NOTHING`` without ``update``)."""
    stmt = insert_for(session, model).values(**values)
    if update:
        result: Insert = stmt.on_conflict_do_update(index_elements=list(keys), set_=dict(update))
    else:
        result = stmt.on_conflict_do_nothing(index_elements=list(keys))
    return result
