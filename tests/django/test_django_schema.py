"""The schema the Django models expect IS the schema Alembic migration 0001 creates (real Postgres).

Both sides are introspected from a live database: the Alembic one (the session's migrated
database) and a scratch database where Django's own schema editor creates every unmanaged model
of ``outbox_django`` and the example shop, exactly as Django would if it managed them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from django.apps import apps
from django.db import connection

from outbox.db import make_engine

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

# Django adds a second, LIKE-only index (varchar_pattern_ops) to every indexed CharField; the
# Alembic schema does not have it. It only speeds up ``startswith`` lookups, which nothing here uses.
DJANGO_ONLY_OPCLASSES = ("varchar_pattern_ops", "text_pattern_ops")


def unmanaged_models() -> list[Any]:
    models = [m for m in apps.get_models() if not m._meta.managed]
    assert {m._meta.db_table for m in models} >= {"outbox", "inbox", "orders", "order_lines", "shipments"}
    return models


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


def create_sql(models: list[Any]) -> list[str]:
    """The CREATE TABLE/INDEX/FK statements Django would run if it managed ``models``.

    The schema editor skips the indexes of unmanaged models, so each model is flagged managed for
    the duration (and restored): exactly "what Django would create", nothing executed here.
    """
    saved = [m._meta.managed for m in models]
    try:
        for m in models:
            m._meta.managed = True
        with connection.schema_editor(collect_sql=True, atomic=False) as editor:
            for model in models:
                editor.create_model(model)
    finally:
        for m, managed in zip(models, saved, strict=True):
            m._meta.managed = managed
    return list(editor.collected_sql)


@pytest.fixture
def django_created_url(django_pg_url: str) -> Iterator[str]:
    """A scratch database where Django's schema editor creates the tables from the models."""
    admin_url = django_pg_url.rsplit("/", 1)[0] + "/postgres"
    name = f"outbox_djschema_{uuid.uuid4().hex[:10]}"
    admin = make_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield django_pg_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def test_django_models_match_the_alembic_schema(django_pg_url: str, django_created_url: str) -> None:
    # Given every unmanaged model and the SQL Django's schema editor would run to create them
    models = unmanaged_models()
    tables = sorted(m._meta.db_table for m in models)
    statements = create_sql(models)
    assert any(s.startswith('CREATE TABLE "outbox"') for s in statements), statements
    # When that SQL runs on an empty database
    scratch = make_engine(django_created_url)
    try:
        with scratch.begin() as c:
            for statement in statements:
                c.exec_driver_sql(statement.replace("%", "%%"))
        django_side = introspect(scratch, tables)
    finally:
        scratch.dispose()
    alembic_engine = make_engine(django_pg_url)
    try:
        alembic_side = introspect(alembic_engine, tables)
    finally:
        alembic_engine.dispose()
    # Then both schemas agree table by table: columns, types, nullability, identity, defaults,
    # primary keys, unique constraints, foreign keys and indexes (incl. the relay's partial index)
    for table in tables:
        assert alembic_side[table]["columns"], f"Alembic created no table {table!r}"
        assert django_side[table] == alembic_side[table], f"table {table!r} differs"
    assert alembic_side["inbox"]["pk"] == ("message_id", "consumer")
    assert ("message_id",) in alembic_side["outbox"]["unique"]
    assert (("seq",), False, "((published_at_ms IS NULL) AND (dead_lettered_at_ms IS NULL))") \
        in alembic_side["outbox"]["indexes"]


def test_schema_comparison_notices_a_difference(django_pg_url: str) -> None:
    # Given the migrated database, then one column of it altered by hand
    engine = make_engine(django_pg_url)
    try:
        before = introspect(engine, ["inbox"])
        with engine.begin() as c:
            c.exec_driver_sql("ALTER TABLE inbox ALTER COLUMN type TYPE varchar(100)")
        after = introspect(engine, ["inbox"])
        with engine.begin() as c:
            c.exec_driver_sql("ALTER TABLE inbox ALTER COLUMN type TYPE varchar(200)")
    finally:
        engine.dispose()
    # Then the introspection the schema test relies on sees it
    assert before != after
    assert after["inbox"]["columns"]["type"][1] == 100
