"""Fixtures shared by every layer.

Service fixtures skip with a clear reason when a server is down locally, and FAIL under CI=true.
Postgres tests get a fresh database per test session (several sessions can run at once).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.outbox import Outbox
from celery_outbox.schema import Tables, define_tables
from celeryconfig import Settings
from orders import migrate
from tests.services import require_service

# The reference deployment names its Outbox like any user does (docker-compose.yml, Makefile): the tests that run
# a bare `outbox` (CliRunner or a process inheriting this environment) run it on relay.app. Tests of how the
# command finds an app when none is named remove it (tests/unit/test_cli_app.py, tests/package/).
os.environ.setdefault("OUTBOX_APP", "relay.app")

PG_ADMIN_URL = os.environ.get("OUTBOX_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RABBITMQ_URL = os.environ.get("OUTBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(scope="session")
def tables() -> Tables:
    """The library's tables under the default prefix, as ``outbox db upgrade`` creates them."""
    return define_tables()


@pytest.fixture
def tmp_home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    return home


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'test.db'}"
    migrate.upgrade(url)
    return url


@pytest.fixture
def sqlite_engine(sqlite_url: str) -> Iterator[sa.Engine]:
    engine = make_engine(sqlite_url)
    yield engine
    engine.dispose()


@pytest.fixture
def sqlite_sessions(sqlite_engine: sa.Engine) -> sessionmaker[Session]:
    return make_session_factory(sqlite_engine)


@pytest.fixture
def sqlite_session(sqlite_sessions: sessionmaker[Session]) -> Iterator[Session]:
    with sqlite_sessions() as s:
        yield s


@contextmanager
def scratch_database(prefix: str) -> Iterator[str]:
    """An empty Postgres database of its own (named ``<prefix>_<hex>``), dropped on the way out."""
    require_service("PostgreSQL", "127.0.0.1", 5432)
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = make_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A migrated database of its own for this test session; dropped at the end."""
    with scratch_database("outbox_test") as url:
        migrate.upgrade(url)
        yield url


@pytest.fixture
def pg_url(pg_database: str) -> Iterator[str]:
    """The session's Postgres database, emptied before each test (schema stays)."""
    engine = make_engine(pg_database)
    with engine.begin() as c:
        tables = c.exec_driver_sql(
            "SELECT tablename FROM pg_tables WHERE schemaname='public' "
            "AND tablename NOT IN ('alembic_version', 'outbox_schema_version')"
        ).scalars().all()
        if tables:
            c.exec_driver_sql("TRUNCATE " + ", ".join(f'"{t}"' for t in tables) + " RESTART IDENTITY CASCADE")
    engine.dispose()
    yield pg_database


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[sa.Engine]:
    engine = make_engine(pg_url)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_sessions(pg_engine: sa.Engine) -> sessionmaker[Session]:
    return make_session_factory(pg_engine)


@pytest.fixture(params=["sqlite", "postgres"])
def any_db_url(request: pytest.FixtureRequest) -> str:
    """The same test on SQLite and on real Postgres (a migrated, empty database)."""
    url: str = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    return url


@pytest.fixture
def any_sessions(any_db_url: str, request: pytest.FixtureRequest) -> sessionmaker[Session]:
    """Sessions on ``any_db_url``."""
    sessions: sessionmaker[Session] = request.getfixturevalue(
        "sqlite_sessions" if any_db_url.startswith("sqlite") else "pg_sessions")
    return sessions


@pytest.fixture
def redis_url() -> str:
    require_service("Redis", "127.0.0.1", 6379)
    return REDIS_URL


@pytest.fixture
def rabbitmq_url() -> str:
    require_service("RabbitMQ", "127.0.0.1", 5672)
    return RABBITMQ_URL


@pytest.fixture
def namespace() -> str:
    """A unique exchange/queue prefix so concurrent runs never share queues on a shared broker."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def settings(tmp_home: Path, sqlite_url: str, namespace: str) -> Settings:
    return Settings(home=tmp_home, database_url=sqlite_url, namespace=namespace, broker_url="memory://")


@pytest.fixture
def outbox(settings: Settings, sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> Outbox:
    """The reference deployment's Outbox on the test's SQLite database, memory broker and manual clock."""
    from relay.factory import create_outbox

    box = create_outbox(settings, session_factory=sqlite_sessions, clock=clock)
    box._tables = tables  # one mapping of the default prefix for the whole test session
    return box
