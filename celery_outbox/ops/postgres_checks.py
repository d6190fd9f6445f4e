"""What ``outbox check`` asks a production Postgres beyond readiness: the grants, the timeouts, the pooler.

docs/deployment.md ("Production Postgres and Redis") says what the library needs of the role the web
app, the workers and the relay connect as, and what a pooler in between changes. These checks look
for the same things from the process's own connection, so they see what that process will get:

- **grants**: each privilege of ``REQUIRED_PRIVILEGES`` on each of the library's tables, by name
  (``has_table_privilege``); a missing one is a failed check (the process would fail at run time);
- **timeouts**: ``statement_timeout``, ``lock_timeout`` and ``idle_in_transaction_session_timeout`` as
  the session has them (the role's, or ``make_engine``'s when connected directly), each against the
  minimum the library is tested at (``timeout_minimums``); one below is a warning;
- **pooler**: whether a transaction pooler sits between the process and Postgres, found by behaviour:
  two connections held open at once, each running a few transactions; directly (or with a session
  pooler) each keeps its own server process, so their ``pg_backend_pid()`` never meet, while a
  transaction pooler lends one server process to both. Then whatever needs a session is named: the
  relay's LISTEN (hears nothing unless ``OUTBOX_RELAY_LISTEN_URL`` is direct, which is checked the same
  way) and psycopg 3's server-side prepared statements. A warning: everything else works there.

A check never raises: a query that fails is a failed check with one masked line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from celery_outbox.config.masking import mask_url
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings

Level = Literal["ok", "warning", "failed"]

# What the web app, the workers and the relay do to each table at run time (docs/deployment.md, "A
# least-privilege role"): row reads and writes only, never DDL, never TRUNCATE or TRIGGER.
DML = ("SELECT", "INSERT", "UPDATE", "DELETE")
VERSION_PRIVILEGES = ("SELECT",)  # the schema version table: read by ``outbox check`` and the readiness probe

# Tested minimums (tests/production/test_least_privilege.py runs the pipeline at them). 0 = off is fine.
MIN_STATEMENT_TIMEOUT_MS = 5_000
MIN_LOCK_TIMEOUT_MS = 1_000
MIN_IDLE_IN_TRANSACTION_MS = 10_000
# The relay keeps its claim's transaction open while the broker confirms the batch (relay/dispatch.py),
# up to OUTBOX_RELAY_PUBLISH_TIMEOUT_S: the idle-in-transaction timeout must leave that much and this margin.
IDLE_MARGIN_MS = 5_000
PID_ROUNDS = 3  # transactions per connection in the pooler test


@dataclass(frozen=True, kw_only=True)
class Finding:
    name: str  # grants | timeouts | pooler
    level: Level
    text: str

    @property
    def ok(self) -> bool:
        return self.level != "failed"

    def line(self) -> str:
        return f"{self.name}: {self.text}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "level": self.level, "text": self.text}


def required_privileges(tables: Tables) -> list[tuple[str, str]]:
    """(table, privilege) pairs the run-time role needs, in a stable order."""
    pairs = [(name, p) for name in tables.names() for p in DML]
    return [*pairs, *((tables.version_table, p) for p in VERSION_PRIVILEGES)]


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def grant_statements(tables: Tables, role: str) -> list[str]:
    """The GRANTs that give ``role`` exactly what the library needs at run time, run by the tables' owner
    after ``outbox db upgrade`` (docs/deployment.md, "A least-privilege role")."""
    names = ", ".join(_ident(n) for n in tables.names())
    return [f"GRANT {', '.join(DML)} ON {names} TO {_ident(role)}",
            f"GRANT {', '.join(VERSION_PRIVILEGES)} ON {_ident(tables.version_table)} TO {_ident(role)}"]


def timeout_minimums(settings: Settings) -> dict[str, int]:
    """The smallest value (ms) of each server timeout the library runs under; 0 (off) always passes."""
    idle = max(MIN_IDLE_IN_TRANSACTION_MS, int(settings.relay_publish_timeout_s * 1000) + IDLE_MARGIN_MS)
    return {"statement_timeout": MIN_STATEMENT_TIMEOUT_MS, "lock_timeout": MIN_LOCK_TIMEOUT_MS,
            "idle_in_transaction_session_timeout": idle}


def _error(e: BaseException) -> str:
    orig = getattr(e, "orig", None) or e
    first = next((ln.strip() for ln in str(orig).splitlines() if ln.strip()), "")
    return str(mask_url(f"{orig.__class__.__name__}: {first}"[:300]))


def missing_grants(session: Session, tables: Tables) -> list[str]:
    """``"DELETE on outbox_inbox"`` for each required privilege the session's role lacks (one statement)."""
    pairs = required_privileges(tables)
    rows = session.execute(
        sa.text("SELECT t, p, to_regclass(t) IS NOT NULL AND has_table_privilege(to_regclass(t), p) "
                "FROM unnest(CAST(:t AS text[]), CAST(:p AS text[])) AS x(t, p)"),
        {"t": [t for t, _ in pairs], "p": [p for _, p in pairs]}).all()
    return [f"{p} on {t}" for t, p, held in rows if not held]


def check_grants(session_factory: sessionmaker[Session], tables: Tables) -> Finding:
    try:
        with session_factory() as session:
            missing = missing_grants(session, tables)
            role = session.execute(sa.text("SELECT current_user")).scalar()
    except Exception as e:
        return Finding(name="grants", level="failed", text=f"could not be read ({_error(e)})")
    if missing:
        return Finding(name="grants", level="failed",
                       text=f"role {role} lacks " + ", ".join(missing) + " (docs/deployment.md, 'A least-privilege role')")
    return Finding(name="grants", level="ok", text=f"role {role} holds every grant the library needs")


def _ms(setting: str, unit: str | None) -> int:
    value = int(setting)
    return value * {"s": 1000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}.get(unit or "ms", 1)


def check_timeouts(session_factory: sessionmaker[Session], settings: Settings) -> Finding:
    minimums = timeout_minimums(settings)
    try:
        with session_factory() as session:
            rows = session.execute(sa.text("SELECT name, setting, unit FROM pg_settings WHERE name IN "
                                           "('statement_timeout', 'lock_timeout', 'idle_in_transaction_session_timeout')"))
            have = {name: _ms(setting, unit) for name, setting, unit in rows}
    except Exception as e:
        return Finding(name="timeouts", level="warning", text=f"could not be read ({_error(e)})")
    low = [f"{name} = {have[name]}ms is below {least}ms" for name, least in minimums.items()
           if 0 < have.get(name, 0) < least]
    if low:
        return Finding(name="timeouts", level="warning",
                       text="; ".join(low) + ": the library may be cut off mid-statement (docs/deployment.md, "
                       "'Timeouts the operator sets')")
    shown = ", ".join(f"{n} {have.get(n, 0)}ms" for n in minimums)
    return Finding(name="timeouts", level="ok", text=shown)


def shares_server_processes(engine: Engine) -> bool:
    """True when two connections of ``engine``, open at once, ever run on the same Postgres server
    process, or one of them changes server process between its transactions: a transaction pooler."""
    with engine.connect() as a, engine.connect() as b:
        seen: dict[str, set[int]] = {"a": set(), "b": set()}
        for _ in range(PID_ROUNDS):
            for name, conn in (("a", a), ("b", b)):
                seen[name].add(int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()))
                conn.commit()
    return bool(seen["a"] & seen["b"]) or len(seen["a"]) > 1 or len(seen["b"]) > 1


def _prepares_on_server(engine: Engine) -> bool:
    """psycopg 3 prepares a statement run 5 times unless ``prepare_threshold`` is None (psycopg2 never does)."""
    if engine.dialect.driver != "psycopg":
        return False
    with engine.connect() as conn:
        return getattr(conn.connection.driver_connection, "prepare_threshold", None) is not None


def check_pooler(session_factory: sessionmaker[Session], settings: Settings) -> Finding:
    engine = session_factory.kw.get("bind")
    if not isinstance(engine, Engine) or engine.dialect.name != "postgresql":
        return Finding(name="pooler", level="ok", text="not Postgres")
    try:
        pooled = shares_server_processes(engine)
        listen_pooled = pooled
        if settings.relay_listen_url:
            from celery_outbox.db import make_engine

            listen = make_engine(settings.relay_listen_url, settings=settings, poolclass=NullPool)
            try:
                listen_pooled = shares_server_processes(listen)
            finally:
                listen.dispose()
        prepares = pooled and _prepares_on_server(engine)
    except Exception as e:
        return Finding(name="pooler", level="warning", text=f"could not be tested ({_error(e)})")
    problems = []
    if listen_pooled:
        via = "OUTBOX_RELAY_LISTEN_URL" if settings.relay_listen_url else "the database URL"
        problems.append(f"the relay's LISTEN through {via} would hear no NOTIFY (outbox relay polls every "
                        f"{settings.relay_poll_interval_s:g}s): give OUTBOX_RELAY_LISTEN_URL a direct connection")
    if prepares:
        problems.append("psycopg 3 prepares statements on the server: pass connect_args={'prepare_threshold': None}")
    if problems:
        where = "a transaction pooler" + (" is between this process and Postgres" if pooled else
                                           " is behind OUTBOX_RELAY_LISTEN_URL")
        return Finding(name="pooler", level="warning",
                       text=f"{where}; " + "; ".join(problems) + " (docs/deployment.md, 'Behind PgBouncer')")
    if pooled:
        return Finding(name="pooler", level="ok",
                       text="a transaction pooler is between this process and Postgres; the relay LISTENs directly")
    return Finding(name="pooler", level="ok", text="none: each connection keeps its own server process")




def production_checks(session_factory: sessionmaker[Session], *, tables: Tables, settings: Settings) -> list[Finding]:
    """Grants, timeouts and pooler (module docstring); empty on a database other than Postgres."""
    engine = session_factory.kw.get("bind")
    if engine is None or getattr(engine, "dialect", None) is None or engine.dialect.name != "postgresql":
        return []
    return [check_grants(session_factory, tables), check_timeouts(session_factory, settings),
            check_pooler(session_factory, settings)]
