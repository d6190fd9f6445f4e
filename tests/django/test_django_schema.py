"""The tables ``manage.py migrate`` creates ARE the tables ``outbox db upgrade`` (Alembic) creates, on Postgres
and SQLite, and a database either chain left at the release before (Django 0009, Alembic co0007) upgrades to it.

Each side is a scratch database of its own: one migrated by the library's Alembic migrations
(``celery_outbox.migrate.upgrade``), one by this app's Django migrations (``migrate celery_outbox`` on a Django
alias added for the test). Both are read back by the checker ``outbox db check`` runs
(celery_outbox/schema_check.py: columns, types, nullability, defaults, identity, keys, CHECKs, indexes with their
partial predicates, the NOTIFY trigger, the autovacuum settings) and must be the same shape, the declared one.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from django.apps import apps
from django.core.management import call_command
from django.db import connections
from django.db.models import Q

from celery_outbox import migrate, schema_check
from celery_outbox.clock import ManualClock
from celery_outbox.contrib.django import database_settings
from celery_outbox.contrib.django.models import condition
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.inbox import handle as inbox
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.schema import define_tables
from consumers.testing import order_placed_envelope
from tests.conftest import scratch_database
from tests.support.old_park import park_as_the_release_before

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
PREVIOUS_DJANGO_HEAD = "0009_autovacuum"  # the release before: the head of this app's migrations then


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Callable[[str, str], str]]:
    """``scratch(backend, name)``: the URL of an empty database of this test's own."""
    with ExitStack() as stack:
        def make(backend: str, name: str) -> str:
            if backend == "sqlite":
                return f"sqlite:///{tmp_path / name}.db"
            return stack.enter_context(scratch_database(f"outbox_schema_{name}"))
        yield make


@contextmanager
def django_alias(url: str) -> Iterator[str]:
    """A Django database alias on ``url`` for the duration (the project's own aliases untouched)."""
    alias = f"scratch_{uuid.uuid4().hex[:8]}"
    connections.settings[alias] = {**connections.settings["default"], **database_settings(url), "TEST": {}}
    try:
        yield alias
    finally:
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]


def django_migrate(url: str, target: str | None = None) -> None:
    """``manage.py migrate celery_outbox [target]`` on the database at ``url``."""
    with django_alias(url) as alias:
        call_command("migrate", "celery_outbox", *([target] if target else []), database=alias, interactive=False,
                     verbosity=0)


def shape(url: str) -> schema_check.SchemaShape:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return schema_check.live(conn, define_tables())
    finally:
        engine.dispose()


@pytest.fixture
def db_access(django_db_blocker: Any) -> Iterator[None]:
    """Database access for the scratch aliases (these tests use no pytest-django test database)."""
    with django_db_blocker.unblock():
        yield


def test_the_apps_models_are_the_librarys_tables() -> None:
    names = sorted(m._meta.db_table for m in apps.get_app_config("celery_outbox").get_models())
    assert names == sorted(define_tables().names())


@pytest.mark.parametrize("backend", BACKENDS)
def test_django_and_alembic_migrations_create_one_schema(backend: str, scratch: Callable[[str, str], str],
                                                         db_access: None) -> None:
    # Given one database migrated by the library's Alembic migrations and one by Django's migrate
    alembic_url, django_url = scratch(backend, "alembic"), scratch(backend, "django")
    migrate.upgrade(alembic_url)
    django_migrate(django_url)
    alembic, django = shape(alembic_url), shape(django_url)
    # Then the two are one schema, table by table, with the same trigger
    assert sorted(django.tables) == sorted(define_tables().names())
    for name in alembic.tables:
        assert django.tables[name] == alembic.tables[name], f"table {name!r} differs"
    assert django.triggers == alembic.triggers
    # and it is the declared one, autovacuum settings included, and recorded at the library's head revision
    for url in (alembic_url, django_url):
        assert migrate.check(url, reloptions=True) == []
        assert migrate.current(url) == migrate.head()
    # and the comparison saw what there is to see: the relay's partial index, the trigger and the settings
    outbox = django.tables["outbox_messages"]
    assert outbox.indexes["ix_outbox_pending"].where == "published_at_ms is null and dead_lettered_at_ms is null"
    assert "outbox_parked_marker" in django.triggers
    if backend == "postgres":
        assert sorted(django.triggers) == ["outbox_notify", "outbox_parked_marker"]
        assert "pg_notify('outbox_pending', '')" in str(django.triggers["outbox_notify"])
        assert outbox.reloptions["autovacuum_vacuum_threshold"] == "5000"
    else:
        assert outbox.columns["payload"].type == "TEXT" and outbox.columns["seq"].generated == "autoincrement"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_database_django_migrated_for_the_release_before_upgrades_on_both_paths(
        backend: str, scratch: Callable[[str, str], str], db_access: None) -> None:
    # Given databases Django's migrations left at the release before's head, with an outbox row
    urls = {"django": scratch(backend, "old_dj"), "alembic": scratch(backend, "old_dj_al")}
    for url in urls.values():
        django_migrate(url, PREVIOUS_DJANGO_HEAD)
        engine = make_engine(url)
        with engine.begin() as c:
            c.execute(sa.text("INSERT INTO outbox_messages (message_id, type, payload, headers, created_at_ms, "
                              "next_attempt_at_ms) VALUES (:id, 'T', '{\"a\": 1}', '{}', 1, 1)"),
                      {"id": uuid.uuid4().hex})
        engine.dispose()
        assert migrate.current(url) == "co0007"
    # When one is upgraded by Django's migrate and the other by `outbox db upgrade`
    django_migrate(urls["django"])
    migrate.upgrade(urls["alembic"])
    # Then both are the declared schema at the head revision, the row kept
    reference = scratch(backend, "fresh")
    migrate.upgrade(reference)
    for url in urls.values():
        assert migrate.check(url, reloptions=True) == [] and migrate.current(url) == migrate.head()
        assert shape(url) == shape(reference)
        engine = make_engine(url)
        with engine.connect() as c:
            assert c.execute(sa.text("SELECT type FROM outbox_messages")).scalars().all() == ["T"]
        engine.dispose()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_message_a_worker_of_the_release_before_parks_marks_its_entity_on_a_django_migrated_database(
        backend: str, scratch: Callable[[str, str], str], db_access: None) -> None:
    # Given a database Django's migrate created, where a new worker applied version 1 of o-1 (marker clear)
    url = scratch(backend, "parked")
    django_migrate(url)
    tables = define_tables()
    engine = make_engine(url)
    try:
        sessions = make_session_factory(engine)
        with sessions() as s:
            assert inbox.handle(s, order_placed_envelope("o-1", version=1), tables=tables, consumer="ledger",
                                handler=lambda s, e: None, clock=ManualClock(), ordering=True) is Outcome.PROCESSED
        # When a worker of the release before parks version 3 (a rolling deploy: its lock leaves the marker alone)
        with sessions() as s:
            park_as_the_release_before(s, order_placed_envelope("o-1", version=3), tables=tables, consumer="ledger")
            s.commit()
        # Then migration 0012's trigger has marked the entity: its next version reads the parked message
        with sessions() as s:
            row = s.get(tables.entity_versions, ("ledger", "order:o-1"))
            assert row is not None and (row.version, row.parked) == (1, 1)
    finally:
        engine.dispose()
    # And undone, the migration takes the trigger with it
    django_migrate(url, "0011_dead_letter_task_id")
    assert "outbox_parked_marker" not in shape(url).triggers


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_outbox_db_check_accepts_the_schema_manage_py_migrate_created(django_pg_url: str) -> None:
    # Given the session's database, created by Django's migrate only (never `outbox db upgrade`)
    # Then it carries the library's revision, and `outbox db check` (revision + schema) finds nothing
    assert migrate.current(django_pg_url) == migrate.head()
    assert migrate.check(django_pg_url) == []
    # and `outbox db upgrade` has nothing to do (no failure on the existing tables and trigger)
    migrate.upgrade(django_pg_url)
    assert migrate.current(django_pg_url) == migrate.head()


def test_the_models_and_the_migrations_agree(db_access: None) -> None:
    # `makemigrations --check`: Django's autodetector sees nothing to migrate in this app. The models are built
    # from schema.py, so a table changed there without a migration of this app fails here
    call_command("makemigrations", "celery_outbox", "--check", "--dry-run", verbosity=0)


def test_a_partial_index_predicate_becomes_its_q_in_order() -> None:
    assert condition("published_at_ms IS NULL AND dedup_key IS NOT NULL") == \
        Q(published_at_ms__isnull=True) & Q(dedup_key__isnull=False)
    with pytest.raises(ValueError, match="is not 'column IS"):
        condition("attempts > 3")
