"""The signals that predict a bloated outbox (docs/operations.md, "Vacuum and bloat"): the oldest transaction
holding back vacuum, replication slots, dead tuples. Postgres only; on SQLite they are absent, not zero."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.cli import cli
from celery_outbox.clock import ManualClock, SystemClock
from celery_outbox.db import make_engine
from celery_outbox.ops import stats as ops_stats
from celery_outbox.ops.metrics import make_registry, render
from tests.ops_seed import T0, outbox_row


def run(env: dict[str, str], *args: str) -> Result:
    sys.modules.pop("relay.app", None)  # built from this env, as a new process would
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def dead_outbox_tuples(sessions: sessionmaker[Session], tables: Tables, n: int) -> None:
    """``n`` outbox rows written then deleted: ``n`` dead tuples, once the writer's statistics are flushed."""
    with sessions() as s:
        for _ in range(n):
            outbox_row(s, tables=tables, created_at_ms=T0)
        s.execute(sa.delete(tables.outbox))
        s.commit()
        if s.execute(sa.text("SELECT to_regproc('pg_stat_force_next_flush')")).scalar() is not None:
            s.execute(sa.text("SELECT pg_stat_force_next_flush()"))  # Postgres 15+: no wait for the next report
            s.commit()


def collect_until(sessions: sessionmaker[Session], tables: Tables, done: Callable[[ops_stats.Stats], bool]
                  ) -> ops_stats.Stats:
    """Statistics reach pg_stat_user_tables asynchronously: collect until ``done(stats)`` or 20 s."""
    deadline = time.monotonic() + 20
    while True:
        with sessions() as s:
            st = ops_stats.collect(s, tables=tables, clock=SystemClock())
        if done(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.2)


def outbox_dead(st: ops_stats.Stats, table: str) -> int:
    assert st.vacuum is not None
    return next(t.dead_tuples for t in st.vacuum.tables if t.table == table)


@pytest.mark.postgres
def test_stats_name_the_transaction_holding_back_vacuum_and_count_dead_tuples(
        pg_url: str, pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    messages, inbox = tables.table(tables.outbox).name, tables.table(tables.inbox).name
    # Given a foreign session holding a transaction open with an xid (a report, a forgotten psql)
    foreign = make_engine(pg_url)
    holder = foreign.connect()
    holder.execute(sa.text("SET application_name = 'forgotten-psql'"))
    holder.execute(sa.text("SELECT txid_current()"))
    pid = holder.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    try:
        # and 30 outbox rows written and deleted meanwhile (their dead tuples cannot be vacuumed)
        dead_outbox_tuples(pg_sessions, tables, 30)
        st = collect_until(pg_sessions, tables, lambda s: outbox_dead(s, messages) >= 30)
        # Then stats name it, with its age in xids (the writes since) and in time
        v = st.vacuum
        assert v is not None and v.oldest_xact_age_xids is not None and v.oldest_xact_age_xids >= 2
        assert v.oldest_xact == f"pid {pid} forgotten-psql (idle in transaction)"
        assert v.oldest_xact_age_ms is not None and v.oldest_xact_age_ms >= 0
        assert {t.table for t in v.tables} == {messages, inbox}
        assert outbox_dead(st, messages) >= 30
        # And the JSON and the metrics carry the same figures
        assert st.to_dict()["vacuum"]["oldest_xact"] == v.oldest_xact
        text = render(make_registry(tables=tables, session_factory=pg_sessions)).decode()
        xids = [float(line.split()[1]) for line in text.splitlines() if line.startswith("outbox_db_oldest_xact_age_xids ")]
        assert len(xids) == 1 and xids[0] >= 2
        assert f'outbox_table_dead_tuples{{table="{messages}"}}' in text
        assert 'outbox_db_replication_slot_xmin_age_xids{kind="xmin"}' in text
    finally:
        holder.rollback()
        holder.close()
        foreign.dispose()
    # When it ends, Then it no longer holds the horizon
    with pg_sessions() as s:
        after = ops_stats.vacuum_stats(s, tables=tables)
    assert after is not None and (after.oldest_xact is None or str(pid) not in after.oldest_xact)


@pytest.mark.postgres
def test_outbox_stats_shows_the_vacuum_signals_in_text_and_json(pg_url: str, pg_sessions: sessionmaker[Session],
                                                                 tables: Tables, tmp_home: Path, namespace: str) -> None:
    env = {"OUTBOX_DATABASE_URL": pg_url, "OUTBOX_HOME": str(tmp_home), "OUTBOX_NAMESPACE": namespace,
           "OUTBOX_BROKER_URL": "memory://"}
    r = run(env, "stats", "--json")
    assert r.exit_code == 0, r.output
    vacuum = json.loads(r.stdout)["vacuum"]
    assert {t["table"] for t in vacuum["tables"]} == {"outbox_messages", "outbox_inbox"}
    assert set(vacuum) == {"oldest_xact_age_xids", "oldest_xact_age_ms", "oldest_xact", "replication_slots", "tables"}
    r = run(env, "stats")
    assert r.exit_code == 0, r.output
    assert "vacuum horizon: " in r.stdout and "dead tuples (pg_stat_user_tables" in r.stdout
    assert "outbox_messages" in r.stdout and "outbox_inbox" in r.stdout


def test_on_sqlite_the_vacuum_signals_are_absent_not_zero(sqlite_sessions: sessionmaker[Session], sqlite_url: str,
                                                         tables: Tables, tmp_home: Path, namespace: str) -> None:
    with sqlite_sessions() as s:
        outbox_row(s, tables=tables, created_at_ms=T0)
        assert ops_stats.collect(s, tables=tables, clock=ManualClock(start_ms=T0)).vacuum is None
    text = render(make_registry(tables=tables, session_factory=sqlite_sessions, clock=ManualClock(start_ms=T0))).decode()
    assert "outbox_stats_up 1.0" in text
    assert "outbox_db_" not in text and "outbox_table_" not in text
    env = {"OUTBOX_DATABASE_URL": sqlite_url, "OUTBOX_HOME": str(tmp_home), "OUTBOX_NAMESPACE": namespace,
           "OUTBOX_BROKER_URL": "memory://"}
    r = run(env, "stats", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["vacuum"] is None
    r = run(env, "stats")
    assert r.exit_code == 0 and "vacuum horizon" not in r.stdout


@pytest.mark.postgres
def test_a_vacuum_view_that_cannot_be_read_leaves_the_other_stats_alone(
        pg_sessions: sessionmaker[Session], tables: Tables, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given a pending row, and a vacuum view the database refuses (a managed server's permissions, say)
    with pg_sessions() as s:
        outbox_row(s, tables=tables, created_at_ms=T0)
    monkeypatch.setattr(ops_stats, "_SLOTS_SQL", "SELECT * FROM no_such_view_here")
    # When stats are collected, Then the vacuum figures are absent, logged, and the rest is there
    with pg_sessions() as s:
        st = ops_stats.collect(s, tables=tables, clock=ManualClock(start_ms=T0))
    assert st.vacuum is None and st.pending == 1
    assert "cannot read the vacuum views" in caplog.text
