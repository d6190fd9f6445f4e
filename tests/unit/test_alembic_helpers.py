"""Alembic users: autogenerate of the team's OWN environment proposes nothing for the library's tables
(``alembic_filters``), and ``outbox db stamp`` records the library's revision for tables made by other means."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from celery import Celery
from click.testing import CliRunner

from celery_outbox import Outbox, Settings, alembic_filters, migrate_database
from celery_outbox.cli import cli
from celery_outbox.migrate import head, library_table_names
from celery_outbox.schema import parked_trigger


def team_metadata(prefix: str = "outbox_") -> sa.MetaData:
    """The team's metadata: its own orders table, and the library's tables put there by define_tables."""
    md = sa.MetaData()
    sa.Table("orders", md, sa.Column("id", sa.String(64), primary_key=True))
    Outbox(Celery("team", broker="memory://", set_as_current=False),
           settings=Settings.from_env({}, database_url="sqlite://", table_prefix=prefix)).define_tables(md)
    return md


def diffs(url: str, md: sa.MetaData, **opts: Any) -> list[Any]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as c:
            return list(compare_metadata(MigrationContext.configure(c, opts=opts), md))
    finally:
        engine.dispose()


@pytest.fixture
def migrated(tmp_path: Path) -> str:
    """The team's database: its orders table (its own migration) and the library's, by `outbox db upgrade`."""
    url = f"sqlite:///{tmp_path / 'team.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE orders (id VARCHAR(64) NOT NULL PRIMARY KEY)")
    engine.dispose()
    migrate_database(url)
    return url


def test_without_the_filters_autogenerate_wants_to_drop_the_version_table(migrated: str) -> None:
    # the problem the helper exists for: the library's version table is in the database, not in any metadata
    removed = [d[1].name for d in diffs(migrated, team_metadata()) if isinstance(d, tuple) and d[0] == "remove_table"]
    assert "outbox_schema_version" in removed


def test_with_the_filters_autogenerate_proposes_nothing_for_the_librarys_tables(migrated: str) -> None:
    # Given the team's metadata holding the library's tables and the database holding them and the version table
    # When the team's env.py passes alembic_filters(), Then autogenerate proposes nothing at all
    assert diffs(migrated, team_metadata(), **alembic_filters()) == []
    # And the team's own tables are still compared: a new table of theirs is proposed
    md = team_metadata()
    sa.Table("invoices", md, sa.Column("id", sa.Integer, primary_key=True))
    assert [d[0] for d in diffs(migrated, md, **alembic_filters())] == ["add_table"]


def test_the_filters_chain_the_teams_own_and_follow_the_table_prefix(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'p.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE orders (id VARCHAR(64) NOT NULL PRIMARY KEY)")
        c.exec_driver_sql("CREATE TABLE legacy_audit (id INTEGER PRIMARY KEY)")
    engine.dispose()
    migrate_database(url, prefix="shop_box_")
    assert "shop_box_schema_version" in library_table_names(prefix="shop_box_")
    # the team's own filter (hide legacy_audit) still applies, after ours
    filters = alembic_filters(prefix="shop_box_", include_name=lambda name, type_, parents: name != "legacy_audit")
    assert diffs(url, team_metadata(prefix="shop_box_"), **filters) == []
    # a filter for another prefix does not hide these tables
    assert diffs(url, team_metadata(prefix="shop_box_"), **alembic_filters()) != []


def test_outbox_db_stamp_records_the_revision_of_tables_made_by_other_means(tmp_path: Path) -> None:
    # Given the library's tables created from the team's metadata (its own Alembic migration), no version
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'own.db'}")
    md = sa.MetaData()
    box = Outbox(Celery("t", broker="memory://", set_as_current=False), engine=engine, settings=Settings.from_env({}))
    box.define_tables(md)
    md.create_all(engine)
    assert CliRunner().invoke(cli, ["db", "check"], obj={"outbox": box}).exit_code == 1
    # When `outbox db stamp` runs, Then the head revision is recorded, nothing else created: the check names the
    # parked marker's trigger, which metadata does not create
    stamped = CliRunner().invoke(cli, ["db", "stamp"], obj={"outbox": box})
    assert stamped.exit_code == 0 and f"stamped at {head()}" in stamped.output
    check = CliRunner().invoke(cli, ["db", "check"], obj={"outbox": box})
    assert check.exit_code == 1 and check.output.splitlines() == ["trigger outbox_parked_marker: missing"]
    # And with the trigger made by other means too, the check passes
    with engine.begin() as c:
        for statement in parked_trigger(box.tables).create("sqlite"):
            c.exec_driver_sql(statement)
    check = CliRunner().invoke(cli, ["db", "check"], obj={"outbox": box})
    assert check.exit_code == 0 and "schema ok" in check.output
    engine.dispose()
