"""The database adapter: engine and session factory, dialect quirks, driver-error wrapping."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from outbox.errors import DatabaseError


class Base(DeclarativeBase):
    """One metadata for orders, outbox, inbox and consumer tables: one set of migrations."""


def normalize_url(url: str) -> str:
    """``postgresql://`` means psycopg2 here (SQLAlchemy 2.1 would pick psycopg 3)."""
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg2://" + url.split("://", 1)[1]
    return url


def make_engine(url: str, *, echo: bool = False, **kwargs: Any) -> Engine:
    """An engine with the settings this system relies on.

    SQLite gets WAL, a long busy timeout and foreign keys, because the demo runs a web app, a relay
    and a worker against one file at once. Postgres gets pre-ping so a restarted server is a blip,
    not a dead relay.
    """
    url = normalize_url(url)
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, echo=echo, connect_args={"timeout": 30}, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # Let SQLAlchemy emit BEGIN itself so a transaction really starts at BEGIN.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # IMMEDIATE takes the write lock up front: no deadlock-upgrade failures between writers.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return sa.create_engine(url, echo=echo, **kwargs)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def is_postgres(session_or_engine: Session | Engine | sa.Connection) -> bool:
    bind = session_or_engine.get_bind() if isinstance(session_or_engine, Session) else session_or_engine
    return bind.dialect.name == "postgresql"


def is_unique_violation(error: exc.IntegrityError) -> bool:
    """True for a primary-key/unique violation on SQLite or Postgres (not FK or NOT NULL)."""
    orig = error.orig
    pgcode = getattr(orig, "pgcode", None)
    if pgcode is not None:
        return bool(pgcode == "23505")
    text = str(orig)
    return "UNIQUE constraint failed" in text or "PRIMARY KEY" in text


@contextmanager
def wrap_driver_errors(what: str) -> Iterator[None]:
    """Turn a bare driver error into ``DatabaseError`` with a message that names the operation."""
    try:
        yield
    except exc.DBAPIError as e:
        raise DatabaseError(f"{what} failed: {e.orig.__class__.__name__}: {e.orig}") from e
