"""The hot tables' autovacuum settings (migration co0007, celery_outbox/autovacuum.py) and what `outbox db check`
shows of them: set by the upgrade, reset by the downgrade, under any table prefix; a no-op on SQLite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner

from celery_outbox import Outbox, Settings, autovacuum, migrate
from celery_outbox.cli import cli
from celery_outbox.db import make_engine
from celery_outbox.schema import define_tables
from tests.conftest import scratch_database

HOT = {"messages", "inbox", "task_receipts", "entity_versions"}


@pytest.fixture
def scratch_pg() -> Iterator[str]:
    """An empty Postgres database of this test's own (migrations run up and down in it)."""
    with scratch_database("outbox_autovac") as url:
        yield url


def reloptions(url: str) -> dict[str, dict[str, str]]:
    """Table -> its autovacuum storage parameters, for every table that has any."""
    engine = make_engine(url)
    try:
        with engine.connect() as c:
            rows = c.execute(sa.text("SELECT c.relname, c.reloptions FROM pg_class c JOIN pg_namespace n "
                                     "ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND c.reloptions IS NOT NULL"))
            return {name: {k: v for k, _, v in (o.partition("=") for o in opts) if k.startswith("autovacuum_")}
                    for name, opts in rows}
    finally:
        engine.dispose()


def server_version(url: str) -> int:
    engine = make_engine(url)
    try:
        with engine.connect() as c:
            return autovacuum.server_version_num(c)
    finally:
        engine.dispose()


def test_the_hot_tables_are_the_ones_written_at_the_message_rate() -> None:
    tables = define_tables(sa.MetaData(), prefix="shop_")
    assert set(autovacuum.hot_tables(tables)) == {f"shop_{t}" for t in HOT}
    # Postgres 12 does not know the insert-triggered options: co0007 must not send them there
    assert "autovacuum_vacuum_insert_threshold" not in autovacuum.options(120000)
    assert autovacuum.options(150000)["autovacuum_vacuum_scale_factor"] == "0"


@pytest.mark.postgres
@pytest.mark.parametrize("prefix", ["outbox_", "shop_"])
def test_co0007_sets_the_hot_tables_settings_and_its_downgrade_resets_them(scratch_pg: str, prefix: str) -> None:
    # Given a database at the revision before
    migrate.upgrade(scratch_pg, "co0006", prefix=prefix)
    assert reloptions(scratch_pg) == {}
    # When co0007 runs, Then exactly the hot tables of this prefix carry the library's settings
    migrate.upgrade(scratch_pg, "co0007", prefix=prefix)
    wanted = autovacuum.options(server_version(scratch_pg))
    assert reloptions(scratch_pg) == {f"{prefix}{t}": wanted for t in HOT}
    assert wanted["autovacuum_vacuum_threshold"] == str(autovacuum.VACUUM_THRESHOLD)
    # When it is downgraded, Then the tables are back on the server's defaults (and the schema is co0006's)
    migrate.downgrade(scratch_pg, "co0006", prefix=prefix)
    assert reloptions(scratch_pg) == {}
    assert migrate.current(scratch_pg, prefix=prefix) == "co0006"
    # And the round trip repeats
    migrate.upgrade(scratch_pg, prefix=prefix)
    assert reloptions(scratch_pg) == {f"{prefix}{t}": wanted for t in HOT}


def test_co0007_is_a_no_op_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    migrate.upgrade(url, "co0007")
    assert migrate.current(url) == "co0007"
    # (the tables are the declared ones, made by co0001; the parked marker's trigger is co0010's)
    assert migrate.check(url) == [f"schema revision is co0007, expected {migrate.head()}: run 'outbox db upgrade'",
                                  "trigger outbox_parked_marker: missing"]
    migrate.downgrade(url, "co0006")
    assert migrate.current(url) == "co0006"


def box_for(url: str, *, prefix: str = "outbox_") -> Outbox:
    return Outbox(Celery("t", broker="memory://", set_as_current=False), engine=make_engine(url),
                  settings=Settings.from_env({"OUTBOX_TABLE_PREFIX": prefix}))


@pytest.mark.postgres
def test_db_check_shows_each_hot_tables_settings_and_flags_missing_ones(scratch_pg: str) -> None:
    migrate.upgrade(scratch_pg)
    box = box_for(scratch_pg)
    # Given the migrated database: every hot table is listed with its settings, none flagged
    ok = CliRunner().invoke(cli, ["db", "check"], obj={"outbox": box})
    assert ok.exit_code == 0 and "schema ok" in ok.stdout, ok.output
    for t in HOT:
        assert f"autovacuum outbox_{t}: " in ok.stdout and "vacuum_threshold=5000" in ok.stdout
    assert "lacks the library's autovacuum settings" not in ok.stderr
    # The server's switch is reported as it is (the shared test server has autovacuum off)
    engine = make_engine(scratch_pg)
    with engine.connect() as c:
        on = c.exec_driver_sql("SHOW autovacuum").scalar() == "on"
    assert ("autovacuum: on (server)" if on else "autovacuum: OFF (server)") in ok.stdout
    assert ("autovacuum is off on this server" in ok.stderr) is (not on)
    # When someone resets one table's settings
    with engine.begin() as c:
        c.exec_driver_sql("ALTER TABLE outbox_inbox RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold)")
    engine.dispose()
    # Then the check names that table and what it falls back to, and still passes (a warning, not a failure)
    flagged = CliRunner().invoke(cli, ["db", "check"], obj={"outbox": box})
    assert flagged.exit_code == 0, flagged.output
    [line] = [x for x in flagged.stderr.splitlines() if "lacks" in x]
    assert line.startswith("warning: outbox_inbox lacks the library's autovacuum settings: ")
    assert "autovacuum_vacuum_scale_factor (server default 0.2)" in line and "outbox db upgrade" in line
    assert "autovacuum outbox_inbox: analyze_scale_factor=0 analyze_threshold=10000" in flagged.stdout
    assert "vacuum_scale_factor=0.2 (server default)" in flagged.stdout
    # When someone turns autovacuum off on one table, Then that is flagged too
    engine = make_engine(scratch_pg)
    with engine.begin() as c:
        c.exec_driver_sql("ALTER TABLE outbox_messages SET (autovacuum_enabled = false)")
    engine.dispose()
    off = CliRunner().invoke(cli, ["db", "check"], obj={"outbox": box})
    assert off.exit_code == 0 and "warning: autovacuum is disabled on outbox_messages" in off.stderr, off.output
    [messages] = [x for x in off.stdout.splitlines() if x.startswith("autovacuum outbox_messages: ")]
    assert " enabled=false " in messages


def test_db_check_on_sqlite_says_nothing_of_autovacuum(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    migrate.upgrade(url)
    r = CliRunner().invoke(cli, ["db", "check"], obj={"outbox": box_for(url)})
    assert r.exit_code == 0 and "autovacuum" not in r.output and "schema ok" in r.output
