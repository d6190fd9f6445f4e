"""The whole pipeline behind PgBouncer in transaction pooling mode (docs/deployment.md, "Behind PgBouncer").

The web side (the order writer), the relay and the workers (consumers, the e-mail task with its
receipts) know only the pooler's URL; the checks read the database directly.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_outbox.clock import SystemClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.schema import Tables
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings
from chaos.environment import ChaosEnvironment
from chaos.processes import BIN
from devtools.processes import wait_until
from tests.outbox_rows import insert_pending
from tests.production import pipeline
from tests.production.pgbouncer import PgBouncer
from tests.services import require_service

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]


def test_the_pipeline_runs_through_a_transaction_pooler(pgbouncer: PgBouncer, tmp_path: Path) -> None:
    require_service("Redis", "127.0.0.1", 6379)
    with ChaosEnvironment(broker="redis", workdir=tmp_path) as env:
        # Given every process of the deployment configured with the pooler's URL only
        env.process_database_url = pgbouncer.url(env.database_url)
        env.relay().start()
        env.worker().start()
        # When the web side commits 30 orders (3 of them rolled back inside their transaction)
        rolled_back = pipeline.place_orders(env, 30, rollback=frozenset({4, 11, 27}))
        pipeline.wait_quiescent(env, committed=27, timeout_s=90)
        # Then every committed order's effects happened exactly once, nothing of a rolled-back one,
        report = pipeline.check(env, rolled_back=rolled_back)
        assert report.ok, report.violations
        assert report.snapshot.effects == {"shipping": 27, "billing": 27, "search": 27, "email": 27}
        # and all of it went through the pooler (its own count of the transactions it passed on)
        assert pgbouncer.transactions(sa.make_url(env.database_url).database or "") > 27 * 4
        # and the relay said in its log that its LISTEN through the pooler hears nothing: it polled
        relay_log = (tmp_path / "logs" / "relay.log").read_text()
        assert "heard no NOTIFY" in relay_log and "listening on" not in relay_log


def run_loop(loop: RelayLoop) -> threading.Thread:
    thread = threading.Thread(target=loop.run, kwargs={"handle_signals": False})
    thread.start()
    return thread


def stop_loop(loop: RelayLoop, thread: threading.Thread) -> None:
    loop.stop()
    thread.join(30)
    loop.close()
    assert not thread.is_alive()


def test_a_relay_behind_the_pooler_says_its_listen_hears_nothing_and_polls(
        pgbouncer: PgBouncer, pg_url: str, tmp_path: Path, tables: Tables, caplog: pytest.LogCaptureFixture) -> None:
    # Given a standalone relay loop whose sessions go through the transaction pooler, polling every 0.2 s
    settings = Settings(home=tmp_path, database_url=pgbouncer.url(pg_url), namespace="pooled",
                        relay_poll_interval_s=0.2)
    engine = make_engine(settings.database_url, settings=settings)
    pub = InMemoryPublisher()
    loop = RelayLoop(settings=settings, tables=tables, session_factory=make_session_factory(engine), publisher=pub,
                     clock=SystemClock())
    caplog.set_level(logging.INFO, logger="celery_outbox.relay.loop")
    thread = run_loop(loop)
    try:
        wait_until(lambda: loop.stats.waits >= 1, timeout_s=30)
        # When a row is committed (its trigger NOTIFYs, through the pooler too)
        ids = {str(i) for i in insert_pending(make_session_factory(engine), SystemClock().now_ms(), 1, tables=tables,
                                              payload=lambda i, mid: {})}
        # Then the relay publishes it by polling,
        assert wait_until(lambda: set(pub.message_ids()) == ids, timeout_s=30)
    finally:
        stop_loop(loop, thread)
        engine.dispose()
    # and it never claimed to listen: its probe NOTIFY went unheard, and one warning line says so
    assert not loop.stats.listening and loop.stats.listen_unheard == 1 and loop.stats.notify_wakeups == 0
    unheard = [r.getMessage() for r in caplog.records if "heard no NOTIFY" in r.getMessage()]
    assert len(unheard) == 1 and "OUTBOX_RELAY_LISTEN_URL" in unheard[0] and "polling every 0.2s" in unheard[0]
    assert not any("listening on" in r.getMessage() for r in caplog.records)


def test_a_direct_listen_url_wakes_a_relay_whose_sessions_go_through_the_pooler(
        pgbouncer: PgBouncer, pg_url: str, tmp_path: Path, tables: Tables) -> None:
    # Given a relay whose sessions go through the pooler, LISTENing on OUTBOX_RELAY_LISTEN_URL (direct), polling
    # only once an hour
    settings = Settings.from_env({"OUTBOX_RELAY_LISTEN_URL": pg_url}, home=tmp_path,
                                 database_url=pgbouncer.url(pg_url), namespace="direct", relay_poll_interval_s=3600.0)
    engine = make_engine(settings.database_url, settings=settings)
    pub = InMemoryPublisher()
    loop = RelayLoop(settings=settings, tables=tables, session_factory=make_session_factory(engine), publisher=pub,
                     clock=SystemClock())
    thread = run_loop(loop)
    try:
        assert wait_until(lambda: loop.stats.listening and loop.stats.waits >= 1, timeout_s=30)
        # When a row is committed through the pooler
        ids = {str(i) for i in insert_pending(make_session_factory(engine), SystemClock().now_ms(), 1, tables=tables,
                                              payload=lambda i, mid: {})}
        # Then its NOTIFY wakes the relay, which publishes it long before the hour-long poll
        assert wait_until(lambda: set(pub.message_ids()) == ids, timeout_s=30)
        assert loop.stats.notify_wakeups >= 1 and loop.stats.poll_wakeups == 0 and loop.stats.listen_unheard == 0
    finally:
        stop_loop(loop, thread)
        engine.dispose()


def outbox_check(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    variables = {**os.environ, "OUTBOX_HOME": str(tmp_path / "home"), "OUTBOX_NAMESPACE": "checked",
                 **{f"OUTBOX_{k.upper()}": v for k, v in env.items()}}
    return subprocess.run([str(BIN / "outbox"), "-A", "relay.app", "check", "--no-broker"], env=variables,
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def test_check_warns_that_the_relays_listen_would_go_through_a_transaction_pooler(
        pgbouncer: PgBouncer, pg_url: str, tmp_path: Path) -> None:
    # Given a process whose database URL goes through the transaction pooler, with no listen URL
    # When the check runs
    done = outbox_check(tmp_path, database_url=pgbouncer.url(pg_url))
    # Then it is ready (everything else works through the pooler) and one warning names the LISTEN and the fix
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ready: database ok, schema ok"
    [line] = done.stderr.splitlines()
    assert line.startswith("warning: pooler: a transaction pooler is between this process and Postgres; the relay's "
                           "LISTEN through the database URL would hear no NOTIFY"), line
    assert "OUTBOX_RELAY_LISTEN_URL" in line
    # And with a direct listen URL, or connected directly, there is nothing to warn about
    direct_listen = outbox_check(tmp_path, database_url=pgbouncer.url(pg_url), relay_listen_url=pg_url)
    assert (direct_listen.returncode, direct_listen.stderr) == (0, "")
    direct = outbox_check(tmp_path, database_url=pg_url)
    assert (direct.returncode, direct.stderr) == (0, "")
    # And a listen URL that goes through the pooler as well is named as such
    pooled_listen = outbox_check(tmp_path, database_url=pg_url, relay_listen_url=pgbouncer.url(pg_url))
    assert "a transaction pooler is behind OUTBOX_RELAY_LISTEN_URL" in pooled_listen.stderr, pooled_listen.stderr
    # And psycopg 3 through the pooler (server-side prepared statements after 5 runs) is named with its fix
    psycopg3_url = sa.make_url(pgbouncer.url(pg_url)).set(drivername="postgresql+psycopg")
    psycopg3 = outbox_check(tmp_path, database_url=psycopg3_url.render_as_string(hide_password=False),
                            relay_listen_url=pg_url)
    assert psycopg3.returncode == 0, psycopg3.stderr
    assert "psycopg 3 prepares statements on the server: pass connect_args={'prepare_threshold': None}" \
        in psycopg3.stderr and "LISTEN" not in psycopg3.stderr, psycopg3.stderr
