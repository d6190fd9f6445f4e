"""The tables ``manage.py migrate`` creates ARE the tables the library's Alembic migration creates (real Postgres).

Both sides are introspected from a live database: the Django one (the session's database, migrated
by Django with the ``celery_outbox.contrib.django`` app's migrations) and a scratch database
migrated by ``celery_outbox.migrate.upgrade`` (what ``outbox db upgrade`` runs).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from django.apps import apps

from celery_outbox import migrate
from celery_outbox.db import make_engine
from celery_outbox.schema import define_tables

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

# Django adds a second, LIKE-only index (varchar_pattern_ops) to every indexed CharField; the
# Alembic schema does not have it. It only speeds up ``startswith`` lookups, which nothing here uses.
DJANGO_ONLY_OPCLASSES = ("varchar_pattern_ops", "text_pattern_ops")


def library_tables() -> list[str]:
    """The tables of the ``celery_outbox.contrib.django`` app's models: exactly the library's."""
    names = sorted(m._meta.db_table for m in apps.get_app_config("celery_outbox").get_models())
    assert names == sorted(define_tables().names())
    return names


def introspect(engine: sa.Engine, tables: list[str]) -> dict[str, dict[str, Any]]:
    """Columns (type, length, nullability, identity, default), primary key, unique sets, FKs, indexes."""
    out: dict[str, dict[str, Any]] = {t: {"columns": {}, "pk": (), "unique": set(), "fks": set(), "indexes": set()}
                                      for t in tables}
    with engine.connect() as c:
        for row in c.execute(sa.text(
            "SELECT table_name, column_name, data_type, character_maximum_length, is_nullable, is_identity, "
            "identity_generation, column_default FROM information_schema.columns "
            "WHERE table_schema = 'public' AND table_name = ANY(:t)"), {"t": tables}):
            out[row.table_name]["columns"][row.column_name] = (
                row.data_type, row.character_maximum_length, row.is_nullable, row.is_identity,
                row.identity_generation, row.column_default)
        for row in c.execute(sa.text(
            "SELECT tc.table_name, tc.constraint_type, "
            "array_agg(kcu.column_name::text ORDER BY kcu.ordinal_position) AS cols "
            "FROM information_schema.table_constraints tc JOIN information_schema.key_column_usage kcu "
            "ON kcu.constraint_name = tc.constraint_name AND kcu.table_name = tc.table_name "
            "AND kcu.constraint_schema = tc.constraint_schema "
            "WHERE tc.table_schema = 'public' AND tc.table_name = ANY(:t) "
            "AND tc.constraint_type IN ('PRIMARY KEY', 'UNIQUE') "
            "GROUP BY tc.table_name, tc.constraint_name, tc.constraint_type"), {"t": tables}):
            if row.constraint_type == "PRIMARY KEY":
                out[row.table_name]["pk"] = tuple(row.cols)
            else:
                out[row.table_name]["unique"].add(tuple(row.cols))
        for row in c.execute(sa.text(
            "SELECT cl.relname AS table_name, a.attname AS col, rc.relname AS ref_table, ra.attname AS ref_col "
            "FROM pg_constraint con JOIN pg_class cl ON cl.oid = con.conrelid "
            "JOIN pg_class rc ON rc.oid = con.confrelid "
            "JOIN pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = ANY(con.conkey) "
            "JOIN pg_attribute ra ON ra.attrelid = con.confrelid AND ra.attnum = ANY(con.confkey) "
            "WHERE con.contype = 'f' AND cl.relname = ANY(:t)"), {"t": tables}):
            out[row.table_name]["fks"].add((row.col, row.ref_table, row.ref_col))
        for row in c.execute(sa.text(
            "SELECT t.relname AS table_name, i.indisunique AS is_unique, "
            "pg_get_expr(i.indpred, i.indrelid) AS predicate, "
            "array(SELECT a.attname::text FROM unnest(i.indkey) WITH ORDINALITY k(attnum, n) "
            "      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum ORDER BY k.n) AS cols, "
            "array(SELECT o.opcname::text FROM unnest(i.indclass) oc(oid) JOIN pg_opclass o ON o.oid = oc.oid) "
            "  AS opclasses "
            "FROM pg_index i JOIN pg_class t ON t.oid = i.indrelid "
            "WHERE t.relname = ANY(:t) AND NOT i.indisprimary "
            "AND NOT EXISTS (SELECT 1 FROM pg_constraint con WHERE con.conindid = i.indexrelid)"), {"t": tables}):
            if set(row.opclasses) & set(DJANGO_ONLY_OPCLASSES):
                continue
            out[row.table_name]["indexes"].add((tuple(row.cols), row.is_unique, row.predicate))
    return out


def triggers(engine: sa.Engine, tables: list[str]) -> set[tuple[str, str, str]]:
    """(table, trigger, definition) of every user trigger on ``tables``, incl. the function's body."""
    with engine.connect() as c:
        return {(r.table_name, r.tgname, r.definition + " / " + r.body) for r in c.execute(sa.text(
            "SELECT cl.relname AS table_name, t.tgname, pg_get_triggerdef(t.oid) AS definition, p.prosrc AS body "
            "FROM pg_trigger t JOIN pg_class cl ON cl.oid = t.tgrelid JOIN pg_proc p ON p.oid = t.tgfoid "
            "WHERE NOT t.tgisinternal AND cl.relname = ANY(:t)"), {"t": tables})}


@pytest.fixture
def alembic_url(django_pg_url: str) -> Iterator[str]:
    """A scratch database migrated by the library's Alembic migrations."""
    admin_url = django_pg_url.rsplit("/", 1)[0] + "/postgres"
    name = f"outbox_djschema_{uuid.uuid4().hex[:10]}"
    admin = make_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        url = django_pg_url.rsplit("/", 1)[0] + f"/{name}"
        migrate.upgrade(url)
        yield url
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def test_django_migrations_create_the_alembic_schema(django_pg_url: str, alembic_url: str) -> None:
    # Given the library's tables as Django's migrate created them and as Alembic created them
    tables = library_tables()
    engines = {"django": make_engine(django_pg_url), "alembic": make_engine(alembic_url)}
    try:
        side = {k: introspect(e, tables) for k, e in engines.items()}
        trigger = {k: triggers(e, tables) for k, e in engines.items()}
    finally:
        for e in engines.values():
            e.dispose()
    # Then both schemas agree table by table: columns, types, nullability, identity, defaults,
    # primary keys, unique constraints, foreign keys and indexes (incl. the relay's partial index)
    for table in tables:
        assert side["alembic"][table]["columns"], f"Alembic created no table {table!r}"
        assert side["django"][table] == side["alembic"][table], f"table {table!r} differs"
    assert side["django"]["outbox_inbox"]["pk"] == ("message_id", "consumer")
    assert ("message_id",) in side["django"]["outbox_messages"]["unique"]
    assert (("seq",), False, "((published_at_ms IS NULL) AND (dead_lettered_at_ms IS NULL))") \
        in side["django"]["outbox_messages"]["indexes"]
    # And the same NOTIFY trigger wakes the relay on both
    assert trigger["django"] == trigger["alembic"]
    [(table, name, definition)] = trigger["django"]
    assert (table, name) == ("outbox_messages", "outbox_notify")
    assert "FOR EACH STATEMENT" in definition and "pg_notify('outbox_pending', '')" in definition


def test_django_index_names_are_the_librarys(django_pg_url: str) -> None:
    engine = make_engine(django_pg_url)
    try:
        with engine.connect() as c:
            names = set(c.execute(sa.text(
                "SELECT indexname FROM pg_indexes WHERE tablename LIKE 'outbox_%'")).scalars())
    finally:
        engine.dispose()
    assert {"ix_outbox_pending", "ix_outbox_published", "ix_outbox_inbox_processed",
            "ix_outbox_dead_letters_consumer", "ix_outbox_parked_entity"} <= names


def test_schema_comparison_notices_a_difference(django_pg_url: str) -> None:
    # Given the migrated database, then one column of it altered by hand
    engine = make_engine(django_pg_url)
    try:
        before = introspect(engine, ["outbox_inbox"])
        with engine.begin() as c:
            c.exec_driver_sql("ALTER TABLE outbox_inbox ALTER COLUMN type TYPE varchar(100)")
        after = introspect(engine, ["outbox_inbox"])
        with engine.begin() as c:
            c.exec_driver_sql("ALTER TABLE outbox_inbox ALTER COLUMN type TYPE varchar(200)")
    finally:
        engine.dispose()
    # Then the introspection the schema test relies on sees it
    assert before != after
    assert after["outbox_inbox"]["columns"]["type"][1] == 100


def test_outbox_db_check_accepts_the_schema_manage_py_migrate_created(django_pg_url: str) -> None:
    # Given the session's database, created by Django's migrate only (never `outbox db upgrade`)
    # Then it carries the library's revision, and `outbox db check` (revision + schema diff) finds nothing
    assert migrate.current(django_pg_url) == migrate.head()
    assert migrate.check(django_pg_url) == []
    # and `outbox db upgrade` has nothing to do (no failure on the existing tables and trigger)
    migrate.upgrade(django_pg_url)
    assert migrate.current(django_pg_url) == migrate.head()
