"""The database adapter: engine and session factory, dialect quirks, driver-error wrapping."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from celery_outbox.errors import EXTRAS, ConfigError, DatabaseError, missing_extra
from celery_outbox.settings import Settings

# Drivers on libpq: they hand connect_args to libpq as connection parameters, and adapt parameters of SQL
# text compiled once themselves (sql.translates_schema, inbox/claim.py, relay/queries.py).
LIBPQ_DRIVERS = frozenset({"psycopg2", "psycopg"})


def postgres_driver() -> str:
    """The driver a plain ``postgresql://`` URL gets: psycopg2 when it is installed, else psycopg 3 (the
    library runs on either alone: the ``[psycopg2]`` and ``[psycopg]`` extras), psycopg2 when neither is
    (``make_engine`` then says which extra to install)."""
    if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
        return "psycopg"
    return "psycopg2"


def normalize_url(url: str) -> str:
    """``postgresql://`` means the installed driver (``postgres_driver``: psycopg2 first), whatever SQLAlchemy's
    own default is (psycopg2 on 2.0, psycopg 3 on 2.1)."""
    if url.startswith(("postgresql://", "postgres://")):
        return f"postgresql+{postgres_driver()}://" + url.split("://", 1)[1]
    return url


def _libpq_version(driver: str) -> int:
    """The libpq the driver runs on (e.g. 160004), 0 when unknown."""
    try:
        if driver == "psycopg2":
            import psycopg2.extensions

            return int(psycopg2.extensions.libpq_version())
        import psycopg

        return int(psycopg.pq.version())
    except Exception:  # a driver we cannot ask: keep to parameters every libpq has
        return 0


def postgres_connect_args(settings: Settings | None = None, *, driver: str = "psycopg2",
                          url_query: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The libpq parameters that keep a silent database from freezing a process.

    ``connect_timeout`` bounds connecting (the whole start-up exchange, not only the TCP handshake);
    TCP keepalives find a dead peer under an idle connection; ``tcp_user_timeout`` (libpq >= 12)
    finds it under a query that was sent and never acknowledged (a firewall drop, a failover without
    RST), where keepalives never start; ``statement_timeout`` and
    ``idle_in_transaction_session_timeout`` (sent as ``options=-c ...`` at connect, so every
    connection, pooled, raw or LISTEN, has them) make the *server* end a stuck statement and release
    the locks of a transaction whose client went silent. A value set in the URL's query string
    (``?connect_timeout=3``, ``?options=...``) wins.
    Behind PgBouncer in transaction mode, add ``options`` to its ``ignore_startup_parameters`` and
    set the two server timeouts on the role instead (``ALTER ROLE ... SET statement_timeout``).
    """
    s = settings if settings is not None else Settings()
    query = url_query or {}
    args: dict[str, Any] = {
        "connect_timeout": s.db_connect_timeout_s,
        "keepalives": 1,
        "keepalives_idle": s.db_keepalives_idle_s,
        "keepalives_interval": s.db_keepalives_interval_s,
        "keepalives_count": s.db_keepalives_count,
    }
    if _libpq_version(driver) >= 120000:
        # The dead-peer time keepalives give an idle connection, for unacknowledged data too.
        args["tcp_user_timeout"] = 1000 * (s.db_keepalives_idle_s + s.db_keepalives_interval_s * s.db_keepalives_count)
    args["options"] = (f"-c statement_timeout={s.db_statement_timeout_ms} "
                       f"-c idle_in_transaction_session_timeout={s.db_idle_in_transaction_timeout_ms}")
    for key in list(args):
        if key in query:
            if key == "options":  # both: libpq applies them in order, so the URL's own -c wins
                given = query[key]
                args[key] = " ".join([args[key], *([given] if isinstance(given, str) else given)])
            else:
                del args[key]
    return args


def _sqlite_directory(path: str) -> None:
    """The SQLite file's directory, created when missing; one that cannot be (``/proc/nope``, a file in the
    way, no permission) is a ``ConfigError`` naming it, not an ``OSError`` traceback at import."""
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file is in the way" if isinstance(e, FileExistsError) else e.strerror or e.__class__.__name__
        raise ConfigError(f"OUTBOX_DATABASE_URL: the SQLite database {path!r} cannot be created: its directory "
                          f"{str(parent)!r} cannot be made ({why})") from None


def make_engine(url: str, *, settings: Settings | None = None, echo: bool = False, **kwargs: Any) -> Engine:
    """An engine with the settings this system relies on (public: build your own engine with it).

    SQLite gets WAL, a long busy timeout and foreign keys, because the demo runs a web app, a relay
    and a worker against one file at once. Postgres gets a pre-ping of every connection that sat idle
    in the pool longer than ``Settings.db_pre_ping_idle_ms`` (``pre_ping_after_idle``), so a restarted
    server is a blip, not a dead relay, and the timeouts and keepalives of ``postgres_connect_args`` from ``settings``
    (the defaults of ``Settings`` when none is given), so a database that stops answering without
    closing the connection makes calls fail instead of hang. ``connect_args=`` you pass win key by
    key. ``Outbox`` builds its engine with this; an engine you pass to ``Outbox`` is used as it is,
    so build it with ``make_engine(url, settings=settings)`` (or give it the same parameters).
    """
    url = normalize_url(url)
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            _sqlite_directory(path)
        engine = sa.create_engine(url, echo=echo, connect_args={"timeout": 30, **kwargs.pop("connect_args", {})},
                                  **kwargs)

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
    idle_ms = (settings if settings is not None else Settings()).db_pre_ping_idle_ms
    pinged_after_idle = "pool_pre_ping" not in kwargs and idle_ms > 0
    if not pinged_after_idle:
        kwargs.setdefault("pool_pre_ping", True)
    parsed = sa.engine.make_url(url)
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() in LIBPQ_DRIVERS:
        ours = postgres_connect_args(settings, driver=parsed.get_driver_name(), url_query=parsed.query)
        kwargs["connect_args"] = {**ours, **kwargs.get("connect_args", {})}
    try:
        engine = sa.create_engine(url, echo=echo, **kwargs)
    except ModuleNotFoundError as e:  # the URL's driver is not installed: one line naming the extra
        if (e.name or "").split(".")[0] not in EXTRAS:
            raise
        raise missing_extra(e.name, needed_by=f"a {parsed.drivername}:// database URL") from None
    if pinged_after_idle:
        pre_ping_after_idle(engine, idle_s=idle_ms / 1000)
    return engine


_CHECKED_IN_AT = "celery_outbox_checked_in_at"


def pre_ping_after_idle(engine: Engine, *, idle_s: float) -> None:
    """Ping a pooled connection at checkout only when it sat in the pool longer than ``idle_s``.

    SQLAlchemy's ``pool_pre_ping`` pings at every checkout: a round trip per consumer delivery at
    saturation, where a connection is back in use milliseconds after its checkin. A connection that
    was idle long enough to have been dropped (a restarted server, a proxy's or firewall's idle
    cut) is pinged as before; when the ping finds it dead, the whole pool is invalidated (every
    connection of the same age is dead too) and the checkout gets a new connection, as with
    ``pool_pre_ping``. A connection that died within ``idle_s`` of its last use fails its first
    statement instead; the consumer delivery runs once more on a new connection (delivery.py,
    ``is_disconnect``). A new connection is never pinged.
    """

    @event.listens_for(engine, "checkin")
    def _checked_in(dbapi_conn: Any, record: Any) -> None:
        if record is not None:
            record.info[_CHECKED_IN_AT] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        since = record.info.pop(_CHECKED_IN_AT, None)
        if since is None or time.monotonic() - since <= idle_s:
            return
        dialect = engine.dialect
        try:
            alive = dialect.do_ping(dbapi_conn)
        except dialect.loaded_dbapi.Error as e:
            if not dialect.is_disconnect(e, dbapi_conn, None):
                raise
            alive = False
        if not alive:  # the pool replaces this connection and every older one, then checks out anew
            raise exc.InvalidatePoolError("the pooled connection was dead at checkout")


def is_disconnect(error: BaseException) -> bool:
    """True when ``error`` (or an error it was raised from) is a driver error that lost its connection."""
    seen: BaseException | None = error
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, exc.DBAPIError) and seen.connection_invalidated:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def resolve_session(session: object, *, verb: str) -> Session:
    """The ``Session`` an ``Outbox`` verb (``publish``, ``cancel``, ``transaction``, ``enqueue``) works in:
    ``session`` itself, or the current session of a ``scoped_session`` (Flask-SQLAlchemy's ``db.session``),
    so every verb takes what the framework hands the application. Anything else is a ``TypeError`` naming
    the verb."""
    if isinstance(session, scoped_session):
        session = session()
    if not isinstance(session, Session):
        raise TypeError(f"outbox.{verb}() needs a SQLAlchemy Session or scoped_session (Flask-SQLAlchemy's "
                        f"db.session), got {type(session).__name__}")
    return session


def is_postgres(session_or_engine: Session | Engine | sa.Connection) -> bool:
    bind = session_or_engine.get_bind() if isinstance(session_or_engine, Session) else session_or_engine
    return bind.dialect.name == "postgresql"


UNIQUE_VIOLATION = "23505"
"""Postgres's SQLSTATE for a unique or primary-key violation."""
_SQLITE_UNIQUE = frozenset({"SQLITE_CONSTRAINT_UNIQUE", "SQLITE_CONSTRAINT_PRIMARYKEY"})


def is_unique_violation(error: BaseException) -> bool:
    """True for a primary-key/unique violation, False for any other error (a foreign key, NOT NULL, CHECK).

    ``error``: SQLAlchemy's ``IntegrityError`` (the driver's error in ``.orig``), Django's ``IntegrityError``
    (the driver's error as ``__cause__``) or the driver's own error. Postgres errors are read by SQLSTATE,
    which psycopg2 calls ``pgcode`` and psycopg 3 ``sqlstate``; SQLite's by its extended error name
    (``sqlite_errorname``), else its message."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        code = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if isinstance(code, str) and code:
            return code == UNIQUE_VIOLATION
        name = getattr(current, "sqlite_errorname", None)
        if isinstance(name, str) and name.startswith("SQLITE_"):
            return name in _SQLITE_UNIQUE
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__
    text = str(getattr(error, "orig", None) or error.__cause__ or error)
    return "UNIQUE constraint failed" in text


_MISSING_TABLE = re.compile(r'no such table|relation "[^"]*" does not exist|undefinedtable', re.IGNORECASE)


def is_missing_table(error: BaseException) -> bool:
    """True when ``error`` (or the driver error it wraps) says a table does not exist: Postgres's UndefinedTable,
    SQLite's "no such table". A database that answers without the outbox tables: the migrations were not run."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _MISSING_TABLE.search(f"{type(current).__name__} {current}"):
            return True
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return False


def missing_tables_hint(outbox: object) -> str:
    """What a person reading a log should do about missing outbox tables: run the command that makes them for
    ``outbox`` (``Outbox.schema_command``: ``python manage.py migrate`` in a Django project with the app installed)."""
    try:
        command = str(getattr(outbox, "schema_command", "outbox db upgrade"))
    except Exception:  # a hint must never hide the error it explains
        command = "outbox db upgrade"
    return f"the outbox tables are missing: run `{command}`"


@contextmanager
def wrap_driver_errors(what: str) -> Iterator[None]:
    """Turn a bare driver error into ``DatabaseError`` with a message that names the operation."""
    try:
        yield
    except exc.DBAPIError as e:
        raise DatabaseError(f"{what} failed: {e.orig.__class__.__name__}: {e.orig}") from e


class ConnectionTracker:
    """The live Postgres connections of an engine, whose sockets another thread can shut down.

    A database that drops packets without a reset leaves a call blocked inside libpq on a socket read
    no timeout of ours reaches: keepalives and ``tcp_user_timeout`` see a live peer whenever something
    on the path still acknowledges (a proxy, a hung server behind a live host), and the server's
    ``statement_timeout`` never hears of the query. Shutting the socket down from outside makes that
    read return at once; the driver raises a disconnect error, SQLAlchemy invalidates the connection
    and its pool, and the next checkout connects anew (the relay's watchdog and its SIGTERM handling,
    relay/loop.py). While attached it records every connection the engine opens or checks out
    (``connect`` and ``checkout`` pool events): the pooled ones, and raw ones like the relay's LISTEN
    connection. SQLite has no socket: ``shutdown_all`` is then a no-op.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._conns: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._attached = False

    def attach(self) -> None:
        """Start recording (Postgres only); connections opened before are closed, so none escapes."""
        if self._attached or self.engine.dialect.name != "postgresql":
            return
        event.listen(self.engine, "connect", self._seen)
        event.listen(self.engine, "checkout", self._seen)
        self._attached = True
        self.engine.dispose()  # checked-in connections opened before: closed; checked-out ones close on return

    def detach(self) -> None:
        if not self._attached:
            return
        event.remove(self.engine, "connect", self._seen)
        event.remove(self.engine, "checkout", self._seen)
        self._attached = False
        with self._lock:
            self._conns.clear()

    def _seen(self, dbapi_conn: Any, *_: Any) -> None:
        with self._lock:
            self._conns.add(getattr(dbapi_conn, "driver_connection", dbapi_conn))

    def shutdown_all(self) -> int:
        """Shut down the socket of every recorded open connection (any thread); returns how many."""
        with self._lock:
            conns = list(self._conns)
        done = 0
        for conn in conns:
            try:
                if getattr(conn, "closed", False):
                    continue
                fd = os.dup(conn.fileno())  # raises once the connection is closed: never another file's fd
            except Exception:
                continue
            try:
                sock = socket.socket(fileno=fd)  # owns the dup from here on
            except OSError:
                with contextlib.suppress(OSError):
                    os.close(fd)
                continue
            with sock, contextlib.suppress(OSError):  # the dup shares the socket: shutdown reaches the original
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
        return done


class SessionSource:
    """One engine per worker process, created lazily after the fork (never shared across processes).

    From a URL it builds the engine with ``make_engine(url, settings=settings)`` (timeouts and
    keepalives from ``settings``); a given engine or session factory is used as it is.
    """

    def __init__(self, *, url: str | None = None, engine: Engine | None = None,
                 session_factory: sessionmaker[Session] | None = None, settings: Settings | None = None) -> None:
        if sum(x is not None for x in (url, engine, session_factory)) != 1:
            raise ConfigError("give exactly one of database_url, engine or session_factory")
        if session_factory is not None and not hasattr(session_factory, "kw"):
            # a scoped_session (Flask-SQLAlchemy style): the library opens its own sessions from its factory
            session_factory = getattr(session_factory, "session_factory", session_factory)
        self._url = url
        self._settings = settings
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
        given = getattr(self._given, "kw", {}) if self._given is not None else {}
        bind = self._engine if self._engine is not None else given.get("bind")
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
                    self._factory = make_session_factory(make_engine(self._url, settings=self._settings))
                elif self._engine is not None:
                    if self._pid is not None:
                        self._engine.dispose(close=False)
                    self._factory = make_session_factory(self._engine)
                else:
                    assert self._given is not None
                    given_bind = getattr(self._given, "kw", {}).get("bind")
                    if self._pid is not None and given_bind is not None:
                        given_bind.dispose(close=False)
                    self._factory = self._given
                self._pid = pid
            return self._factory

    def close(self) -> None:
        """Close the pooled connections of the engine this source built from a URL (a given engine or
        session factory is its owner's to dispose). The next use opens new ones."""
        with self._lock:
            if self._url is not None and self._factory is not None and self._pid == os.getpid():
                bind = self._factory.kw.get("bind")
                if bind is not None:
                    bind.dispose()
            if self._url is not None:
                self._factory = None
                self._pid = None
