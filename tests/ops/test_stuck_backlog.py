"""A backlog that cannot hide: ``outbox stats --max-overdue`` fires for due rows no relay publishes, and never
for rows backing off after a failed publish (their next attempt is in the future)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from click.testing import CliRunner, Result
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.cli import cli
from celery_outbox.clock import ManualClock, SystemClock
from celery_outbox.ops import stats as ops_stats
from tests.ops_seed import T0, outbox_row


def test_backing_off_rows_are_not_overdue_and_due_ones_are(sqlite_session: Session, tables: Tables,
                                                           clock: ManualClock) -> None:
    # Given a row that failed to publish 10 times and backs off until T0 + 10 min, created an hour earlier
    row = outbox_row(sqlite_session, tables=tables, created_at_ms=T0 - 3_600_000, attempts=10, last_error="nacked")
    row.next_attempt_at_ms = T0 + 600_000
    sqlite_session.commit()
    clock.set(T0)
    # Then it is old but not overdue
    st = ops_stats.collect(sqlite_session, tables=tables, clock=clock)
    assert (st.oldest_pending_age_ms, st.oldest_overdue_ms) == (3_600_000, None)
    # When a new row is due at T0 and nothing publishes it for 90 s
    outbox_row(sqlite_session, tables=tables, created_at_ms=T0)
    clock.set(T0 + 90_000)
    # Then it is overdue by 90 s, and the backing-off row still is not
    st = ops_stats.collect(sqlite_session, tables=tables, clock=clock)
    assert st.oldest_overdue_ms == 90_000


def run(env: dict[str, str], *args: str) -> Result:
    sys.modules.pop("relay.app", None)  # built from this env, as a new process would
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def test_stats_max_overdue_sets_the_exit_code(sqlite_sessions: sessionmaker[Session], sqlite_url: str, tables: Tables,
                                              tmp_home: Path, namespace: str) -> None:
    env = {"OUTBOX_DATABASE_URL": sqlite_url, "OUTBOX_HOME": str(tmp_home), "OUTBOX_NAMESPACE": namespace,
           "OUTBOX_BROKER_URL": "memory://"}
    now = SystemClock().now_ms()
    with sqlite_sessions() as s:
        backing_off = outbox_row(s, tables=tables, created_at_ms=now - 3_600_000, attempts=5, last_error="nacked")
        backing_off.next_attempt_at_ms = now + 3_600_000
        s.commit()
    # Given only a row backing off: the check passes
    r = run(env, "stats", "--max-overdue", "1m", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["thresholds"] == [{"name": "max_overdue_ms", "limit": 60_000, "value": None,
                                                   "crossed": False}]
    # Given a row due for 5 minutes that no relay published: exit 3, one line saying why
    with sqlite_sessions() as s:
        outbox_row(s, tables=tables, created_at_ms=now - 300_000)
    r = run(env, "stats", "--max-overdue", "1m")
    assert r.exit_code == 3
    assert "has been due for 5m" in r.stderr and "no relay has published it" in r.stderr


def test_sqlite_never_reports_a_held_claim(sqlite_sessions: sessionmaker[Session], sqlite_url: str, tables: Tables,
                                           tmp_home: Path, namespace: str) -> None:
    # Given a SQLite outbox with a due row (its relay commits the claim before publishing: nothing stays held)
    env = {"OUTBOX_DATABASE_URL": sqlite_url, "OUTBOX_HOME": str(tmp_home), "OUTBOX_NAMESPACE": namespace,
           "OUTBOX_BROKER_URL": "memory://"}
    with sqlite_sessions() as s:
        outbox_row(s, tables=tables, created_at_ms=SystemClock().now_ms())
    # When --max-claim-held is asked for
    r = run(env, "stats", "--max-claim-held", "1s", "--json")
    # Then it is reported, never crossed, and the stats say there is no claim
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["outbox"]["claim_held_ms"] is None
    assert data["thresholds"] == [{"name": "max_claim_held_ms", "limit": 1_000, "value": None, "crossed": False}]
