"""Migrations and models agree, on SQLite and Postgres; upgrade/downgrade round-trips."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

import consumers.models
import orders.models
from outbox import migrate
from outbox.db import Base, make_engine

_ = (orders.models, consumers.models)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_migrations_match_models(request: pytest.FixtureRequest, backend: str) -> None:
    url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    engine = make_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == [], f"models and migrations disagree: {diff}"


def test_upgrade_downgrade_roundtrip(tmp_path: object) -> None:
    url = f"sqlite:///{tmp_path}/rt.db"
    migrate.upgrade(url)
    assert migrate.current(url) is not None
    migrate.downgrade(url)
    assert migrate.current(url) is None
    engine = make_engine(url)
    assert set(sa.inspect(engine).get_table_names()) <= {"alembic_version"}
    engine.dispose()
