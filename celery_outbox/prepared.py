"""Server-side prepared statements on psycopg2 (SQL ``PREPARE`` / ``EXECUTE``) for a hot statement whose
parsing and planning cost Postgres more than running it: the relay's claim (docs/benchmarks.md, "The relay's
claim as a prepared statement").

psycopg2 sends every statement as text, which Postgres parses and plans at each run. A ``Prepared`` statement
is prepared once per database connection, in the transaction of its first run (a prepared statement is not
transactional: a rollback keeps it), remembered in the pooled connection's ``info`` (which goes with the DBAPI
connection: a new connection prepares again), then executed by name; not on an engine without a pool, where
every use is a new connection. Its name is derived from its text, so two different statements never share a
name, on one connection or across a pooler's server connections.

A transaction pooler (PgBouncer in transaction mode) runs a client's transactions on whichever server
connection is free and does not carry SQL-level prepared statements between them. The first run that finds the
statement missing there, or already prepared under its name, turns this object off: it logs one warning, the
caller rolls its transaction back (nothing else ran in it) and runs the text, and every later run sends the text.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

log = logging.getLogger(__name__)

INFO_KEY = "celery_outbox.prepared"
# invalid_sql_statement_name (EXECUTE of a name this server connection does not have) and
# duplicate_prepared_statement (PREPARE of a name it already has): what a transaction pooler's moves look like
LOST = frozenset({"26000", "42P05"})


class Prepared:
    """``text`` (psycopg2's ``%(name)s`` parameters), prepared with the parameter ``types`` (SQL type names,
    in any order; every parameter of ``text`` must have one)."""

    def __init__(self, *, text: str, types: Mapping[str, str], label: str) -> None:
        names: list[str] = []

        def positional(match: re.Match[str]) -> str:
            if match.group(1) not in names:
                names.append(match.group(1))
            return f"${names.index(match.group(1)) + 1}"

        body = re.sub(r"%\((\w+)\)s", positional, text).replace("%%", "%")  # sent without parameters
        missing = [n for n in names if n not in types]
        if missing:
            raise ValueError(f"no SQL type for parameter(s) {', '.join(missing)}")
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        self.text, self.label, self.enabled = text, label, True
        self.name = f"outbox_{digest}"
        self.prepare_sql = f"PREPARE {self.name}({', '.join(types[n] for n in names)}) AS {body}"
        self.execute_sql = f"EXECUTE {self.name}({', '.join(f'%({n})s' for n in names)})"

    def execute(self, connection: sa.Connection, params: Mapping[str, Any]) -> sa.CursorResult[Any]:
        """Run the statement by name on ``connection`` (preparing it first on a connection that has not);
        the text once this object is off."""
        if not self.enabled or isinstance(connection.engine.pool, NullPool):  # a connection per use: no gain
            return connection.exec_driver_sql(self.text, dict(params))
        done: set[str] = connection.connection.info.setdefault(INFO_KEY, set())
        if self.name not in done:
            connection.exec_driver_sql(self.prepare_sql)
            done.add(self.name)
        return connection.exec_driver_sql(self.execute_sql, dict(params))

    def lost(self, error: BaseException) -> bool:
        """Whether ``error`` says the statement is missing or already prepared on this server connection (a
        transaction pooler): then this object is off, and the caller rolls back and runs the text."""
        orig = getattr(error, "orig", None)
        if not self.enabled or getattr(orig, "pgcode", None) not in LOST:
            return False
        self.enabled = False
        log.warning("outbox: the %s cannot stay prepared on the server (a transaction pooler such as PgBouncer?): "
                    "sent as text from now on", self.label)
        return True
