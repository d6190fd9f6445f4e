"""Timeouts the operator sets on the role, as managed services do (docs/deployment.md, "Timeouts the
operator sets"): at the minimums ``postgres_checks.timeout_minimums`` documents, nothing the library
runs is cut off; below one, ``outbox check`` warns.

The processes go through PgBouncer as the least-privilege role, so the role's settings are what their
sessions get (PgBouncer drops the ``options`` ``make_engine`` would send); the relay LISTENs directly.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_outbox.db import make_engine
from celery_outbox.ops.postgres_checks import timeout_minimums
from celeryconfig import Settings
from chaos.environment import CHAOS_ENV
from chaos.processes import BIN
from tests.production import pipeline
from tests.production.conftest import require_pgbouncer
from tests.production.pgbouncer import PgBouncer
from tests.production.roles import RolesEnvironment, role_names
from tests.services import require_service

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# What Postgres says (and psycopg2 raises) when one of the three timeouts ends a statement or a session
CUT_OFF = ("canceling statement due to statement timeout", "canceling statement due to lock timeout",
           "idle-in-transaction timeout", "QueryCanceled", "LockNotAvailable", "IdleInTransactionSessionTimeout")


@contextmanager
def pooled_app_role(tmp_path: Path, role_settings: Mapping[str, str]) -> Iterator[RolesEnvironment]:
    require_service("PostgreSQL", "127.0.0.1", 5432)
    require_service("Redis", "127.0.0.1", 6379)
    owner, app = role_names()
    with PgBouncer(executable=require_pgbouncer(), users=("postgres", app)) as bouncer, \
            RolesEnvironment(broker="redis", workdir=tmp_path, owner=owner, app=app, role_settings=role_settings,
                             pooler=bouncer) as env:
        env.extra_env["OUTBOX_RELAY_LISTEN_URL"] = env.url_as(app)  # direct: LISTEN past the pooler
        yield env


def session_timeouts(url: str) -> dict[str, str]:
    engine = make_engine(url)
    try:
        with engine.connect() as c:
            return {n: str(c.execute(sa.text(f"SHOW {n}")).scalar())
                    for n in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout")}
    finally:
        engine.dispose()


def outbox_check(env: RolesEnvironment) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "outbox"), "-A", "relay.app", "check", "--no-broker"],
                          env={**os.environ, **env.env}, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)


def test_the_pipeline_runs_under_the_role_timeouts_at_their_minimums(tmp_path: Path) -> None:
    least = {name: f"{ms // 1000}s" for name, ms in timeout_minimums(Settings.from_env(CHAOS_ENV)).items()}
    with pooled_app_role(tmp_path, role_settings=least) as env:
        # Given the app role with each server timeout at its documented minimum, which is what the
        # processes' sessions through the pooler get
        assert session_timeouts(env.process_database_url) == least == {
            "statement_timeout": "5s", "lock_timeout": "1s", "idle_in_transaction_session_timeout": "10s"}
        env.relay().start()
        env.worker().start()
        # When orders are committed (two rolled back) and a poison message is dead-lettered
        rolled_back = pipeline.place_orders(env, 40, rollback=frozenset({7, 30}))
        poison = [env.poison(consumer="search")]
        pipeline.wait_quiescent(env, committed=38, dead_letters=1, timeout_s=90)
        # Then every effect happened once, the relay LISTENed (directly), no statement was cut off,
        report = pipeline.check(env, rolled_back=rolled_back, poison=poison)
        assert report.ok, report.violations
        assert "listening on outbox_pending through OUTBOX_RELAY_LISTEN_URL" in (tmp_path / "logs" / "relay.log").read_text()
        logs = "".join(p.log_path.read_text(errors="replace") for p in env.processes.members)
        assert not [w for w in CUT_OFF if w in logs], env.logs()
        # and the check has nothing to say about them
        done = outbox_check(env)
        assert (done.returncode, done.stderr) == (0, ""), done.stderr


def test_check_warns_about_a_role_timeout_below_its_minimum(tmp_path: Path) -> None:
    # Given the app role with a 1 s statement_timeout (the minimum is 5 s) and a 200 ms lock_timeout
    with pooled_app_role(tmp_path, role_settings={"statement_timeout": "1s", "lock_timeout": "200ms"}) as env:
        # When the check runs through the pooler
        done = outbox_check(env)
        # Then it stays ready and one warning names both, with their minimums
        assert done.returncode == 0, done.stderr
        assert done.stderr.splitlines() == [
            "warning: timeouts: statement_timeout = 1000ms is below 5000ms; lock_timeout = 200ms is below 1000ms: "
            "the library may be cut off mid-statement (docs/deployment.md, 'Timeouts the operator sets')"]
