"""SQLAlchemy sessions on Django's OWN connection, inside the ``atomic()`` Django has open.

The inbox core (``celery_outbox.inbox``: the claim, per-entity ordering, parking) is written once, on a
SQLAlchemy session. A Django consumer's effect writes with the Django ORM, and rule 6 wants the effect, the
inbox row and the ordering bookkeeping in ONE transaction. So the core's statements run on the very DB-API
connection Django's ``atomic()`` uses: SQLAlchemy borrows it (``Lent``) for the block, and only Django ends
the transaction (SQLAlchemy's commit, rollback and close of a borrowed connection do nothing). The same
core then serves both frameworks; a second implementation of the ordering rules would drift.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Engine, pool
from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2
from sqlalchemy.orm import Session

from celery_outbox.errors import ConfigError


class Lent:
    """Django's DB-API connection as SQLAlchemy sees it: statements run in Django's transaction; ending it
    (commit, rollback, close) is left to Django's ``atomic()``."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        return self._raw.cursor(*args, **kwargs)

    def commit(self) -> None:
        """Django's ``atomic()`` commits."""

    def rollback(self) -> None:
        """Django's ``atomic()`` rolls back (an exception leaving the block)."""

    def close(self) -> None:
        """The connection is Django's: it stays open."""

    def add_notice_handler(self, handler: Any) -> None:
        """psycopg: SQLAlchemy adds a handler at every checkout; Django's connection keeps only its own."""

    def create_function(self, *args: Any, **kwargs: Any) -> None:
        """sqlite3: SQLAlchemy registers its ``regexp`` and ``floor`` at every checkout, which would replace
        Django's own (its ``FLOOR`` accepts NULL); the library's statements use neither."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class LentPsycopg2Dialect(PGDialect_psycopg2):
    """psycopg2's dialect without its per-connection setup: it registers the UUID adapter through psycopg2's C
    functions, which refuse anything but a real psycopg2 connection (a ``Lent`` is a wrapper), and Django's
    psycopg2 backend has registered that adapter for every connection already."""

    supports_statement_cache = True  # the same SQL as its parent's

    def on_connect(self) -> None:
        return None


def _lent_url(url: str) -> str:
    """The URL the lent engine is built on: psycopg2's goes through ``LentPsycopg2Dialect``."""
    if not url.startswith("postgresql+psycopg2://"):
        return url
    from sqlalchemy.dialects import registry

    registry.register("postgresql.celery_outbox_lent_psycopg2", __name__, "LentPsycopg2Dialect")
    return "postgresql+celery_outbox_lent_psycopg2://"


def dialect_url(alias: str) -> str:
    """The SQLAlchemy dialect of Django's connection ``alias``: its vendor and its own DB-API driver (the SQL
    is compiled for the driver that runs it: psycopg 3 or psycopg2, or sqlite3)."""
    from django.db import connections

    connection = connections[alias]
    if connection.vendor == "sqlite":
        return "sqlite://"
    if connection.vendor == "postgresql":
        driver = connection.Database.__name__  # "psycopg" or "psycopg2"
        return f"postgresql+{driver}://"
    raise ConfigError(f"Django database {alias!r} is {connection.vendor}; only PostgreSQL and SQLite are supported")


class LentSessions:
    """One engine per (process, alias, driver), built on first use; each hands out Django's current
    connection of the calling thread. Held by the consumer spec (no module-level state)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[tuple[int, str, str], Engine] = {}

    def _engine(self, alias: str) -> Engine:
        from django.db import connections

        url = dialect_url(alias)
        key = (os.getpid(), alias, url)
        with self._lock:
            engine = self._engines.get(key)
            if engine is None:
                # hstore discovery wants the driver's own connection class, and the library has no hstore
                options: dict[str, Any] = {"use_native_hstore": False} if url.startswith("postgresql") else {}
                # the claim reads the row count of its INSERT ... ON CONFLICT DO NOTHING, which SQLAlchemy's
                # psycopg 3 dialect reports as -1 unless asked to keep it
                engine = self._engines[key] = sa.create_engine(
                    _lent_url(url), creator=lambda: Lent(connections[alias].connection), poolclass=pool.NullPool,
                    execution_options={"preserve_rowcount": True}, **options)
            return engine

    @contextmanager
    def session(self, alias: str) -> Iterator[Session]:
        """A session whose statements run in the ``atomic()`` open on ``alias`` (required)."""
        from django.db import transaction

        connection = transaction.get_connection(alias)
        if not connection.in_atomic_block:
            raise ConfigError(f"a session on Django's connection {alias!r} needs an open atomic() block")
        connection.ensure_connection()
        with Session(bind=self._engine(alias), autoflush=False) as session:
            yield session
            session.flush()
