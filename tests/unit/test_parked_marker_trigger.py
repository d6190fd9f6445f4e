"""The parked marker's trigger (``schema.parked_trigger``; Alembic co0010, Django 0012): a message a worker of the
release before parks, on an entity a new worker has marked clear, is still released by the entity's next version.

The release before locked the entity's row without setting the marker (tests/support/old_park.py); during a rolling
deploy its workers park beside new ones that clear it. Without the trigger the next version would skip the read of
the entity's parked messages and leave the parked one to its park timeout (a dead letter, a replay).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import migrate
from celery_outbox.clock import ManualClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.inbox import handle as inbox
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.ops.postgres_checks import grant_statements
from celery_outbox.schema import Tables, define_tables, parked_trigger
from consumers.testing import order_placed_envelope
from tests.conftest import PG_ADMIN_URL, scratch_database
from tests.support.locks import waits_on_a_lock
from tests.support.old_park import park_as_the_release_before

CONSUMER = "ledger"


def deliver(sessions: sessionmaker[Session], version: int, applied: list[int], *, tables: Tables) -> Outcome:
    with sessions() as s:
        return inbox.handle(s, order_placed_envelope("o-1", version=version), tables=tables, consumer=CONSUMER,
                            handler=lambda s, e: applied.append(int(e.headers["entity_version"])),
                            clock=ManualClock(), ordering=True)


def marker(sessions: sessionmaker[Session], tables: Tables) -> tuple[int, int]:
    with sessions() as s:
        row = s.get(tables.entity_versions, (CONSUMER, "order:o-1"))
        assert row is not None
        return row.version, row.parked


def old_worker_parks(sessions: sessionmaker[Session], version: int, *, tables: Tables) -> None:
    with sessions() as s:
        park_as_the_release_before(s, order_placed_envelope("o-1", version=version), tables=tables, consumer=CONSUMER)
        s.commit()


def test_a_message_an_old_worker_parks_on_a_cleared_entity_is_released_by_the_next_version(
        any_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a migrated database where a new worker applied version 1 of o-1: its row says nothing is parked
    applied: list[int] = []
    assert deliver(any_sessions, 1, applied, tables=tables) is Outcome.PROCESSED
    assert marker(any_sessions, tables) == (1, 0)
    # When a worker of the release before parks version 3 (its lock leaves the marker alone)
    old_worker_parks(any_sessions, 3, tables=tables)
    # Then the trigger has marked the entity, and a new worker's version 2 applies 2, then the parked 3
    assert marker(any_sessions, tables) == (1, 1)
    assert deliver(any_sessions, 2, applied, tables=tables) is Outcome.PROCESSED
    assert applied == [1, 2, 3]
    assert marker(any_sessions, tables) == (3, 0)


@pytest.mark.postgres
def test_the_next_version_waits_for_an_old_worker_parking_its_successor_and_releases_it(
        pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given version 1 of o-1 applied by a new worker: the row says nothing is parked
    applied: list[int] = []
    assert deliver(pg_sessions, 1, applied, tables=tables) is Outcome.PROCESSED
    outcomes: list[Outcome] = []
    errors: list[BaseException] = []

    def version_two() -> None:
        try:
            outcomes.append(deliver(pg_sessions, 2, applied, tables=tables))
        except BaseException as e:  # surfaced below
            errors.append(e)

    with pg_sessions() as parking:
        # And version 3 parked by a worker of the release before, not committed yet (it holds the entity's row)
        park_as_the_release_before(parking, order_placed_envelope("o-1", version=3), tables=tables,
                                   consumer=CONSUMER)
        thread = threading.Thread(target=version_two)
        thread.start()
        # When a new worker's version 2 arrives meanwhile, Then its advance waits on that row lock
        assert waits_on_a_lock(pg_sessions, thread) and outcomes == []
        parking.commit()
    # And once the park committed, the advance returns the marker its trigger set: 2 applied, then the parked 3
    thread.join(timeout=30)
    assert errors == [] and outcomes == [Outcome.PROCESSED]
    assert applied == [1, 2, 3]
    assert marker(pg_sessions, tables) == (3, 0)


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_the_trigger_follows_the_prefix_and_goes_with_its_revision(backend: str, tmp_path: object) -> None:
    with scratch(backend, tmp_path) as url:
        # Given a database of prefix shop_ migrated to the head
        migrate.upgrade(url, prefix="shop_")
        tables = define_tables(prefix="shop_")
        engine = make_engine(url)
        try:
            sessions = make_session_factory(engine)
            applied: list[int] = []
            assert deliver(sessions, 1, applied, tables=tables) is Outcome.PROCESSED
            # Then its own trigger marks its own entity rows
            old_worker_parks(sessions, 3, tables=tables)
            assert marker(sessions, tables) == (1, 1)
            # When co0010 is undone, Then the trigger (and on Postgres its function) goes with the column
            migrate.downgrade(url, "co0009", prefix="shop_")
            assert trigger_objects(engine, tables) == set()
            # And the upgrade brings them back: the schema check finds the declared schema
            migrate.upgrade(url, prefix="shop_")
            assert trigger_objects(engine, tables) == {"shop_parked_marker"}
            assert migrate.check(url, prefix="shop_") == []
            # And one dropped is the check's one difference
            with engine.begin() as c:
                for statement in parked_trigger(tables).drop(engine.dialect.name):
                    c.exec_driver_sql(statement)
            assert migrate.check(url, prefix="shop_") == ["trigger shop_parked_marker: missing"]
        finally:
            engine.dispose()


@contextmanager
def scratch(backend: str, tmp_path: object) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path}/trigger.db"
        return
    with scratch_database("outbox_parked_trigger") as url:
        yield url


def trigger_objects(engine: sa.Engine, tables: Tables) -> set[str]:
    """The parked marker's trigger and function as the database holds them (their names)."""
    name = parked_trigger(tables).name
    with engine.connect() as c:
        if engine.dialect.name == "sqlite":
            return set(c.execute(sa.text("SELECT name FROM sqlite_master WHERE type = 'trigger' AND name = :n"),
                                 {"n": name}).scalars())
        triggers = set(c.execute(sa.text("SELECT tgname FROM pg_trigger WHERE tgname = :n"), {"n": name}).scalars())
        functions = set(c.execute(sa.text("SELECT proname FROM pg_proc WHERE proname = :n"), {"n": name}).scalars())
    assert triggers == functions, (triggers, functions)
    return triggers


@pytest.mark.postgres
def test_the_trigger_runs_as_a_least_privileged_role_and_under_a_schema_translate_map() -> None:
    tag = uuid.uuid4().hex[:8]
    owner, app = f"outbox_owner_{tag}", f"outbox_app_{tag}"
    admin = make_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE ROLE "{owner}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE')
        c.exec_driver_sql(f'CREATE ROLE "{app}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT')
    try:
        with scratch_database("outbox_parked_roles") as url:
            as_owner, as_app = (sa.make_url(url).set(username=r).render_as_string(hide_password=False)
                                for r in (owner, app))
            # Given the library's tables in schema shop, migrated by their owner (rule 17, docs/deployment.md),
            # and the app role with only the documented grants (and the schema's USAGE)
            engine = make_engine(url)
            with engine.begin() as c:
                c.exec_driver_sql(f'CREATE SCHEMA shop AUTHORIZATION "{owner}"')
                c.exec_driver_sql(f'GRANT USAGE ON SCHEMA shop TO "{app}"')
            engine.dispose()
            migrate.upgrade(f"{as_owner}?options=-csearch_path%3Dshop")
            tables = define_tables()
            owner_engine = make_engine(f"{as_owner}?options=-csearch_path%3Dshop")
            with owner_engine.begin() as c:
                for statement in grant_statements(tables, app):
                    c.exec_driver_sql(statement)
            owner_engine.dispose()
            # When the app role, its search_path not naming shop (the tables reached by a schema_translate_map),
            # delivers version 1 as a new worker, then parks version 3 as the release before did
            app_engine = make_engine(as_app).execution_options(schema_translate_map={None: "shop"})
            try:
                sessions = make_session_factory(app_engine)
                applied: list[int] = []
                assert deliver(sessions, 1, applied, tables=tables) is Outcome.PROCESSED
                assert marker(sessions, tables) == (1, 0)
                old_worker_parks(sessions, 3, tables=tables)
                # Then the trigger marked the entity, and version 2 releases the parked 3
                assert marker(sessions, tables) == (1, 1)
                assert deliver(sessions, 2, applied, tables=tables) is Outcome.PROCESSED
                assert applied == [1, 2, 3]
            finally:
                app_engine.dispose()
    finally:
        with admin.connect() as c:
            for role in (app, owner):
                c.exec_driver_sql(f'DROP ROLE IF EXISTS "{role}"')
        admin.dispose()
