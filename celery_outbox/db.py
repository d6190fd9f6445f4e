"""The database adapter: engine and session factory, dialect quirks, driver-error wrapping."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.errors import ConfigError, DatabaseError


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


class SessionSource:
    """One engine per worker process, created lazily after the fork (never shared across processes)."""

    def __init__(self, *, url: str | None = None, engine: Engine | None = None,
                 session_factory: sessionmaker[Session] | None = None) -> None:
        if sum(x is not None for x in (url, engine, session_factory)) != 1:
            raise ConfigError("give exactly one of database_url, engine or session_factory")
        self._url = url
        self._engine = engine
        self._given = session_factory
        self._pid: int | None = None
        self._factory: sessionmaker[Session] | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        """The database URL with its password (for the relay's SQLite lock file; never printed)."""
        if self._url is not None:
            return self._url
        bind = self._engine if self._engine is not None else (self._given.kw.get("bind") if self._given else None)
        return bind.url.render_as_string(hide_password=False) if bind is not None else ""

    def __call__(self) -> sessionmaker[Session]:
        pid = os.getpid()
        factory = self._factory
        if factory is not None and self._pid == pid:
            return factory
        with self._lock:
            if self._factory is None or self._pid != pid:
                if self._factory is not None and self._url is not None:
                    bind = self._factory.kw.get("bind")
                    if bind is not None:
                        bind.dispose(close=False)  # the parent's pool: forget it, never close its sockets
                if self._url is not None:
                    self._factory = make_session_factory(make_engine(self._url))
                elif self._engine is not None:
                    if self._pid is not None:
                        self._engine.dispose(close=False)
                    self._factory = make_session_factory(self._engine)
                else:
                    assert self._given is not None
                    given_bind = self._given.kw.get("bind")
                    if self._pid is not None and given_bind is not None:
                        given_bind.dispose(close=False)
                    self._factory = self._given
                self._pid = pid
            return self._factory
