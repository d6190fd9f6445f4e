"""Migrations and models agree, on SQLite and Postgres; upgrade/downgrade round-trips.

Two sets of migrations share one database: the library's (``celery_outbox/migrations``, the
``outbox_*`` tables, version table ``outbox_schema_version``) and the reference deployment's own
(``orders/migrations``, orders and the consumers' effects, Alembic's default ``alembic_version``).
Each must match its models, create only its own tables and undo exactly what it did.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from celery import Celery
from click.testing import CliRunner

import consumers.models
import orders.migrate
import orders.models
from celery_outbox import Outbox, Settings, migrate
from celery_outbox.cli import cli
from celery_outbox.clock import ManualClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.inbox import handle as inbox
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.schema import PENDING_SQL, Tables, define_tables
from consumers.testing import order_placed_envelope
from tests.conftest import scratch_database

_ = orders.models  # its models join consumers.models.Base.metadata

LIBRARY_VERSION_TABLE = "outbox_schema_version"
LIBRARY_TABLES = {"outbox_messages", "outbox_inbox", "outbox_attempts", "outbox_dead_letters", "outbox_parked",
                  "outbox_entity_versions", "outbox_counters", "outbox_task_receipts", "outbox_workers"}
DEPLOYMENT_TABLES = {"orders", "order_lines", "shipments", "invoices", "search_documents", "sent_emails"}


def table_names(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def deployment_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(orders.migrate.MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def deployment_revision(url: str) -> str | None:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def pending_index_sql(url: str) -> str:
    """The DDL of the relay's partial index on the pending outbox rows, as the database holds it."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "postgresql":
                sql = conn.execute(sa.text("SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_outbox_pending'"
                                           " AND tablename = 'outbox_messages'")).scalar_one_or_none()
            else:
                sql = conn.execute(sa.text("SELECT sql FROM sqlite_master WHERE type = 'index' AND "
                                           "name = 'ix_outbox_pending' AND tbl_name = 'outbox_messages'")
                                   ).scalar_one_or_none()
    finally:
        engine.dispose()
    assert sql is not None, "the partial index ix_outbox_pending is missing"
    return str(sql)


def test_the_table_sets_are_the_models(tables: Tables) -> None:
    assert set(tables.names()) == LIBRARY_TABLES and tables.version_table == LIBRARY_VERSION_TABLE
    assert set(consumers.models.Base.metadata.tables) == DEPLOYMENT_TABLES


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_migrations_match_models(request: pytest.FixtureRequest, backend: str) -> None:
    url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    # Both sets of migrations ran (the fixtures run orders.migrate.upgrade): each set's tables, nothing else
    assert table_names(url) == LIBRARY_TABLES | DEPLOYMENT_TABLES | {LIBRARY_VERSION_TABLE, "alembic_version"}
    # The library's tables match define_tables() and are at the library's head revision
    assert migrate.check(url) == [], "library models and migrations disagree"
    assert migrate.current(url) == migrate.head()
    # The deployment's tables match its models (the library's tables are not its business)

    def deployment_only(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        table = obj if type_ == "table" else getattr(obj, "table", None)
        return (table.name if table is not None else name) not in LIBRARY_TABLES | {LIBRARY_VERSION_TABLE}

    engine = make_engine(url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"include_object": deployment_only})
        diff = unreflectable_identity_dropped(compare_metadata(ctx, consumers.models.Base.metadata), conn.dialect)
    engine.dispose()
    assert diff == [], f"deployment models and migrations disagree: {diff}"
    assert deployment_revision(url) == "orders0001"


def unreflectable_identity_dropped(diff: list[Any], dialect: sa.engine.Dialect) -> list[Any]:
    """``diff`` without "add an identity" where the database has no identity columns to reflect (SQLite): Alembic
    before 1.18 reports every ``Identity()`` column there as missing one (docs/compatibility.md, the oldest job);
    later releases report nothing. Any other difference, on that column or elsewhere, stays."""
    if dialect.supports_identity_columns:
        return diff

    def unreflectable(op: Any) -> bool:
        return (isinstance(op, tuple) and op[0] == "modify_default" and op[5] is None
                and isinstance(op[6], sa.Identity))

    kept = [[op for op in group if not unreflectable(op)] if isinstance(group, list) else group for group in diff]
    return [group for group in kept if group != []]


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_the_relay_query_has_its_partial_index(request: pytest.FixtureRequest, backend: str) -> None:
    url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    sql = " ".join(pending_index_sql(url).split()).lower()
    assert "(seq)" in sql and "where" in sql
    assert "published_at_ms is null" in sql and "dead_lettered_at_ms is null" in sql, sql
    assert " ".join(PENDING_SQL.split()).lower() in sql.replace("(", "").replace(")", ""), sql


def test_library_upgrade_downgrade_roundtrip_touches_only_library_tables(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/rt.db"
    migrate.upgrade(url)
    assert migrate.current(url) == migrate.head() is not None
    assert table_names(url) == LIBRARY_TABLES | {LIBRARY_VERSION_TABLE}  # no alembic_version, no app table
    assert pending_index_sql(url)
    migrate.downgrade(url)
    assert migrate.current(url) is None
    assert table_names(url) <= {LIBRARY_VERSION_TABLE}


def test_deployment_upgrade_downgrade_roundtrip_leaves_the_library_alone(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/rt.db"
    orders.migrate.upgrade(url)
    assert table_names(url) == LIBRARY_TABLES | DEPLOYMENT_TABLES | {LIBRARY_VERSION_TABLE, "alembic_version"}
    assert deployment_revision(url) == "orders0001" and migrate.current(url) == migrate.head()
    # Undo the deployment's own migrations: its tables go, the library's stay at their head
    command.downgrade(deployment_config(url), "base")
    assert deployment_revision(url) is None
    assert table_names(url) - {"alembic_version"} == LIBRARY_TABLES | {LIBRARY_VERSION_TABLE}
    assert migrate.current(url) == migrate.head() and migrate.check(url) == []
    # Then the library's: nothing of either is left but the version tables
    migrate.downgrade(url)
    assert migrate.current(url) is None
    assert table_names(url) <= {LIBRARY_VERSION_TABLE, "alembic_version"}
    # And upgrading again recreates both (the round trip is repeatable)
    orders.migrate.upgrade(url)
    assert table_names(url) == LIBRARY_TABLES | DEPLOYMENT_TABLES | {LIBRARY_VERSION_TABLE, "alembic_version"}


def test_postgres_notifies_the_standalone_relay_on_insert(pg_url: str, tables: Tables) -> None:
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            triggers = conn.execute(sa.text(
                "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal AND tgrelid = 'outbox_messages'::regclass"
            )).scalars().all()
    finally:
        engine.dispose()
    assert triggers == ["outbox_notify"] and tables.notify_channel == "outbox_pending"


def test_a_database_created_before_task_receipts_gets_them_on_upgrade(tmp_path: Path) -> None:
    # Given a library database at revision co0001 as an older release created it (no receipts table)
    url = f"sqlite:///{tmp_path}/old.db"
    migrate.upgrade(url)
    migrate.downgrade(url, "co0001")  # co0002's downgrade drops the receipts table
    assert migrate.current(url) == "co0001"
    assert "outbox_task_receipts" not in table_names(url)
    # When it is upgraded, the receipts table and its index appear and the schema matches the models
    migrate.upgrade(url)
    assert migrate.current(url) == migrate.head()
    assert table_names(url) == LIBRARY_TABLES | {LIBRARY_VERSION_TABLE}
    assert migrate.check(url) == []


DATA = Path(__file__).resolve().parents[1] / "data"


def insert_message(url: str, payload: str = '{"a": 1}') -> int:
    engine = make_engine(url)
    try:
        with engine.begin() as c:
            c.execute(sa.text("INSERT INTO outbox_messages (message_id, type, payload, headers, created_at_ms, "
                              "next_attempt_at_ms) VALUES (:id, 'T', :payload, '{}', 1, 1)"),
                      {"id": uuid.uuid4().hex, "payload": payload})
            return int(c.execute(sa.text("SELECT max(seq) FROM outbox_messages")).scalar_one())
    finally:
        engine.dispose()


def release_before(backend: str, tmp_path: Path, stack: ExitStack) -> str:
    """A database exactly as `outbox db upgrade` of the release before left it (its schema, at co0007)."""
    url = (f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite"
           else stack.enter_context(scratch_database("outbox_old")))
    sql = (DATA / f"co0007_{backend}.sql").read_text()
    if backend == "sqlite":
        with closing(sqlite3.connect(tmp_path / "old.db")) as c:
            c.executescript(sql)
    else:
        engine = make_engine(url)
        with engine.begin() as c:
            c.exec_driver_sql(sql)
        engine.dispose()
    assert migrate.current(url) == "co0007"
    return url


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_database_the_release_before_left_upgrades_to_the_declared_schema(backend: str, tmp_path: Path) -> None:
    with ExitStack() as stack:
        # Given a database exactly as `outbox db upgrade` of the release before left it (its schema, at co0007)
        url = release_before(backend, tmp_path, stack)
        first = insert_message(url)
        if backend == "sqlite":  # and a row written around the library's writer, not strict JSON (jsonb refuses it)
            insert_message(url, '{"total": NaN}')
        # When it is upgraded
        migrate.upgrade(url)
        # Then it is the declared schema (autovacuum settings included), at the head, its rows kept
        assert migrate.check(url, reloptions=True) == [] and migrate.current(url) == migrate.head()
        engine = make_engine(url)
        with engine.begin() as c:
            kept = c.execute(sa.text("SELECT seq, payload FROM outbox_messages ORDER BY seq")).all()
            assert kept[0] in ((first, '{"a": 1}'), (first, {"a": 1}))
            assert len(kept) == (2 if backend == "sqlite" else 1)
            # and the newest row's key is never given again once it is deleted
            c.execute(sa.text("DELETE FROM outbox_messages"))
        engine.dispose()
        assert insert_message(url) > first


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_an_entity_with_parked_messages_before_the_marker_still_releases_them(backend: str, tmp_path: Path) -> None:
    with ExitStack() as stack:
        # Given a database of the release before, with entity o-1 at version 1 and its version 3 parked
        url = release_before(backend, tmp_path, stack)
        early = order_placed_envelope("o-1", version=3)
        engine = make_engine(url)
        with engine.begin() as c:
            c.execute(sa.text("INSERT INTO outbox_entity_versions (consumer, entity_key, version) "
                              "VALUES ('ledger', 'order:o-1', 1)"))
            c.execute(sa.text("INSERT INTO outbox_parked (message_id, consumer, entity_key, entity_version, envelope, "
                              "parked_at_ms) VALUES (:id, 'ledger', 'order:o-1', 3, :envelope, 1)"),
                      {"id": early.message_id.hex, "envelope": json.dumps(early.to_dict())})
        engine.dispose()
        # When it is upgraded, Then the entity's row says it may have parked messages
        migrate.upgrade(url)
        assert migrate.check(url) == []
        engine = make_engine(url)
        stack.callback(engine.dispose)
        sessions = make_session_factory(engine)
        tables = define_tables()
        with sessions() as s:
            assert s.get(tables.entity_versions, ("ledger", "order:o-1")).parked == 1  # type: ignore[union-attr]
        # And version 2 reads them: it applies 2, then the parked 3
        applied: list[int] = []
        with sessions() as s:
            assert inbox.handle(s, order_placed_envelope("o-1", version=2), tables=tables, consumer="ledger",
                                handler=lambda s, e: applied.append(int(e.headers["entity_version"])),
                                clock=ManualClock(), ordering=True) is Outcome.PROCESSED
        assert applied == [2, 3]
        with sessions() as s:
            row = s.get(tables.entity_versions, ("ledger", "order:o-1"))
            assert row is not None and (row.version, row.parked) == (3, 0)


def test_the_schema_check_names_each_difference(tmp_path: Path) -> None:
    # Given a database at the head, then altered by hand: a partial index without its predicate, a column
    # made nullable, an index of someone else's
    url = f"sqlite:///{tmp_path / 'drift.db'}"
    migrate.upgrade(url)
    assert migrate.check(url) == []
    with closing(sqlite3.connect(tmp_path / "drift.db")) as c, c:
        c.execute("DROP INDEX ix_outbox_dead")
        c.execute("CREATE INDEX ix_outbox_dead ON outbox_messages (seq)")
        c.execute("CREATE INDEX ix_mine ON outbox_inbox (type)")
        c.execute("ALTER TABLE outbox_counters ADD COLUMN note TEXT")
    # Then the check says each, in one line, and `outbox db check` prints them and exits 1
    expected = [
        "index ix_outbox_dead on outbox_messages: is (seq), declared (seq) where dead_lettered_at_ms is not null",
        "index ix_mine on outbox_inbox: not declared ((type))",
        "column outbox_counters.note: not declared (TEXT NULL)",
    ]
    assert migrate.check(url) == expected
    box = Outbox(Celery("t", broker="memory://", set_as_current=False), engine=make_engine(url),
                 settings=Settings.from_env({}))
    result = CliRunner().invoke(cli, ["db", "check"], obj={"outbox": box})
    assert result.exit_code == 1 and result.stderr.splitlines() == expected, result.output


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_the_schema_check_follows_the_table_prefix(backend: str, tmp_path: Path) -> None:
    with ExitStack() as stack:
        url = (f"sqlite:///{tmp_path / 'p.db'}" if backend == "sqlite"
               else stack.enter_context(scratch_database("outbox_prefix")))
        # Given two prefixes' tables in one database, each migrated by `outbox db upgrade --prefix`
        migrate.upgrade(url, prefix="shop_")
        migrate.upgrade(url)
        # Then each prefix's check sees its own tables (and on Postgres its own trigger and settings), all declared
        assert migrate.check(url, prefix="shop_", reloptions=True) == []
        assert migrate.check(url, reloptions=True) == []
        # And one prefix's trigger dropped is that prefix's difference only
        if backend == "postgres":
            engine = make_engine(url)
            with engine.begin() as c:
                c.exec_driver_sql("DROP TRIGGER shop_notify ON shop_messages")
            engine.dispose()
            assert migrate.check(url, prefix="shop_") == ["trigger shop_notify: missing"]
            assert migrate.check(url) == []
