"""Every engine the library builds carries the timeouts and keepalives that keep a silent database from
freezing a process; the values are read back from the server and from libpq, not from our own dict."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy import exc

from celery_outbox import Outbox, Settings, make_engine
from celery_outbox.celery.config import consumer_time_limits
from celery_outbox.db import SessionSource
from celery_outbox.errors import ConfigError
from celery_outbox.messages import task_name
from celery_outbox.relay.loop import _PgListener
from tests.support.blackhole_proxy import BlackholeProxy

TIGHT = Settings(db_connect_timeout_s=3, db_statement_timeout_ms=1234, db_idle_in_transaction_timeout_ms=5678,
                 db_keepalives_idle_s=7, db_keepalives_interval_s=2, db_keepalives_count=4)


def _server_timeouts(conn: sa.Connection) -> tuple[str, str]:
    return (conn.exec_driver_sql("SHOW statement_timeout").scalar_one(),
            conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar_one())


def _libpq(dbapi_conn: Any) -> dict[str, str]:
    """The connection's libpq parameters: psycopg2's get_dsn_parameters(), psycopg 3's info.get_parameters()."""
    read = getattr(dbapi_conn, "get_dsn_parameters", None) or dbapi_conn.info.get_parameters
    params: dict[str, str] = read()
    return params


@pytest.fixture
def tight_engine(pg_url: str) -> Iterator[sa.Engine]:
    engine = make_engine(pg_url, settings=TIGHT)
    yield engine
    engine.dispose()


@pytest.mark.postgres
def test_a_postgres_engine_carries_the_settings_timeouts_and_keepalives(tight_engine: sa.Engine) -> None:
    # Given an engine built from settings with distinctive values
    # When a connection is opened
    with tight_engine.connect() as conn:
        # Then the server applies both timeouts to the session
        assert _server_timeouts(conn) == ("1234ms", "5678ms")
        # And libpq connected with the connect timeout and the keepalives
        params = _libpq(conn.connection.driver_connection)
    assert {k: params[k] for k in ("connect_timeout", "keepalives", "keepalives_idle", "keepalives_interval",
                                   "keepalives_count")} == {"connect_timeout": "3", "keepalives": "1",
                                                            "keepalives_idle": "7", "keepalives_interval": "2",
                                                            "keepalives_count": "4"}
    # And unacknowledged data gives up after as long as keepalives give an idle connection (libpq >= 12)
    assert params["tcp_user_timeout"] == str(1000 * (7 + 2 * 4))
    # And pre-ping only after the idle window, not SQLAlchemy's ping on every checkout (tests/unit/test_db_idle_ping.py)
    assert not tight_engine.pool._pre_ping


@pytest.mark.postgres
def test_without_settings_the_engine_gets_the_default_settings(pg_url: str) -> None:
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            # Then the defaults of Settings apply, never "no timeout at all"
            assert _server_timeouts(conn) == (f"{Settings().db_statement_timeout_ms // 1000}s",
                                              f"{Settings().db_idle_in_transaction_timeout_ms // 60000}min")
            assert _libpq(conn.connection.driver_connection)["connect_timeout"] == str(Settings().db_connect_timeout_s)
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_the_server_really_cancels_a_long_statement_and_ends_an_idle_transaction(pg_url: str) -> None:
    engine = make_engine(pg_url, settings=Settings(db_statement_timeout_ms=200, db_idle_in_transaction_timeout_ms=300))
    try:
        # Given a statement that would run for a minute
        # When it runs on an engine with a 200 ms statement timeout
        with engine.connect() as conn, pytest.raises(exc.OperationalError, match="statement timeout"):
            conn.exec_driver_sql("SELECT pg_sleep(60)")
        # Given a transaction whose client goes silent while holding it open
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
            # When it stays idle past the idle-in-transaction timeout (the server ends the session)
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
            watcher = make_engine(pg_url)
            try:
                # Then the server ends that session on its own (polled: no timing assertion)
                deadline = time.monotonic() + 30
                alive = 1
                while alive and time.monotonic() < deadline:
                    time.sleep(0.1)
                    with watcher.connect() as w:
                        alive = w.exec_driver_sql("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                                  (pid,)).scalar_one()
            finally:
                watcher.dispose()
            assert alive == 0
            with pytest.raises(exc.DBAPIError):
                conn.exec_driver_sql("SELECT 1")
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_values_in_the_url_and_given_connect_args_win(pg_url: str) -> None:
    # Given a URL that sets its own connect timeout and statement timeout
    url = pg_url + "?connect_timeout=4&options=-c%20statement_timeout%3D777"
    # And connect_args that set the keepalive idle time
    engine = make_engine(url, settings=TIGHT, connect_args={"keepalives_idle": 11})
    try:
        with engine.connect() as conn:
            params = _libpq(conn.connection.driver_connection)
            # Then each value given explicitly wins; the rest still comes from the settings
            assert (params["connect_timeout"], params["keepalives_idle"], params["keepalives_count"]) == ("4", "11", "4")
            assert _server_timeouts(conn) == ("777ms", "5678ms")
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_the_relays_listen_connection_has_them_too(tight_engine: sa.Engine) -> None:
    # Given the standalone relay's LISTEN connection, taken raw from the same engine
    listener = _PgListener(tight_engine, "outbox_pending")
    try:
        # Then a dead socket under it is found by keepalives, and its select() wakes on the poll interval
        params = _libpq(listener.conn)
        assert (params["keepalives"], params["keepalives_idle"], params["connect_timeout"]) == ("1", "7", "3")
        with listener.conn.cursor() as cur:
            cur.execute("SHOW statement_timeout")
            assert cur.fetchone() == ("1234ms",)
    finally:
        listener.close()


@pytest.mark.postgres
def test_outbox_builds_its_engine_from_its_settings(pg_url: str) -> None:
    # Given an Outbox configured with a URL and distinctive timeouts
    outbox = Outbox(Celery("t", set_as_current=False), settings=TIGHT.replace(database_url=pg_url))
    engine = outbox.sessions().kw["bind"]
    try:
        # Then the engine it builds carries them
        with engine.connect() as conn:
            assert _server_timeouts(conn) == ("1234ms", "5678ms")
    finally:
        engine.dispose()


def test_an_engine_the_user_passes_is_used_as_it_is(tmp_path: Any) -> None:
    # Given the user's own engine
    engine = make_engine(f"sqlite:///{tmp_path / 'own.db'}")
    # When the Outbox is built with it
    outbox = Outbox(Celery("t", set_as_current=False), engine=engine, settings=TIGHT)
    # Then it is not rebuilt (the user chose its options; make_engine(url, settings=...) is the helper)
    assert outbox.sessions().kw["bind"] is engine
    engine.dispose()


def test_session_source_passes_its_settings_to_make_engine(tmp_path: Any) -> None:
    source = SessionSource(url=f"sqlite:///{tmp_path / 'x.db'}", settings=TIGHT)
    engine = source().kw["bind"]
    try:
        # Then SQLite keeps its long busy timeout (the Postgres timeouts do not apply to it)
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one() == 30000
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_connecting_to_a_silent_server_gives_up_after_the_connect_timeout(pg_url: str) -> None:
    parsed = sa.engine.make_url(pg_url)
    with BlackholeProxy(parsed.host or "127.0.0.1", parsed.port or 5432) as proxy:
        # Given a database that accepts the TCP connection and then never answers
        proxy.blackhole()
        engine = make_engine(parsed.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False),
                             settings=Settings(db_connect_timeout_s=2))
        outcome: list[BaseException | None] = []

        def connect() -> None:
            try:
                with engine.connect():
                    outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        # When a connection is opened
        t = threading.Thread(target=connect, daemon=True)
        t.start()
        t.join(timeout=60)  # the bound a hang would blow through (the setting is 2 s)
        # Then it fails with a driver error instead of hanging
        assert not t.is_alive(), "connect hung on a silent server"
        assert len(outcome) == 1 and isinstance(outcome[0], exc.OperationalError), outcome
        engine.dispose()


def test_consumer_time_limits_follow_the_setting() -> None:
    for hard in (1, 2, 5, 30, 120, 299):
        soft, limit = consumer_time_limits(Settings(consumer_time_limit_s=hard))
        assert limit == hard and 0 < soft < limit


def test_a_consumer_task_has_a_time_limit_and_requeues_a_hard_kill(outbox: Outbox) -> None:
    # Given the deployment's Outbox and its consumers
    soft, hard = consumer_time_limits(outbox.settings)
    names = outbox.registry.names()
    assert names
    for name in names:
        task = outbox.app.tasks[task_name(name)]
        # Then each consumer task is killed after the configured time
        assert (task.time_limit, task.soft_time_limit) == (hard, soft)
        # And the kill rejects the message with requeue (Celery >= 5.7 reads acks_on_timeout) instead of
        # acking it, so it comes back marked redelivered and the delivery is counted
        assert task.acks_late is True and task.acks_on_timeout is False and task.reject_on_worker_lost is True


@pytest.mark.parametrize(("url", "why"), [("sqlite:////proc/nope/x.db", "No such file or directory"),
                                          ("sqlite:////dev/null/x.db", "a file is in the way")])
def test_a_sqlite_file_whose_directory_cannot_be_made_is_a_config_error(url: str, why: str) -> None:
    # Given a SQLite URL whose directory cannot be created; When the engine is built
    # Then a ConfigError naming the variable and why (an entry point prints it as one line), not an OSError
    with pytest.raises(ConfigError, match=rf"OUTBOX_DATABASE_URL: .* cannot be made \({why}\)"):
        make_engine(url)
