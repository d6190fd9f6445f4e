"""Probes and exit codes: ``outbox check``, the web app's ``/readyz`` and ``/healthz``, ``outbox stats``
thresholds and ``--version``.

Every "down" case points at a loopback port nothing listens on, with a password in the URL that must
never be shown: the database, the broker or both are down for real, no mock.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from flask.testing import FlaskClient
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.cli import cli
from celery_outbox.cli.probes import EXIT_PROBLEM
from celery_outbox.clock import SystemClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.ops import health
from celery_outbox.schema import Tables
from celeryconfig import Settings
from relay.web import create_app
from tests.ops_seed import consumer_dead_letter, envelope, outbox_row

PASSWORD = "pw-never-shown"
HOUR = 3_600_000


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def pg_down_url() -> str:
    return f"postgresql://probe_user:{PASSWORD}@127.0.0.1:{closed_port()}/orders"


def assert_no_internals(text: str, *extra: str) -> None:
    lowered = text.lower()
    for secret in (PASSWORD, "probe_user", "127.0.0.1", "psycopg", "sqlalchemy", "operationalerror",
                   "connection refused", "traceback", *extra):
        assert secret.lower() not in lowered, text


@pytest.fixture
def env(sqlite_url: str, tmp_home: Path, namespace: str) -> dict[str, str]:
    """A migrated SQLite database and the memory broker: everything is up."""
    return {"OUTBOX_DATABASE_URL": sqlite_url, "OUTBOX_HOME": str(tmp_home), "OUTBOX_NAMESPACE": namespace,
            "OUTBOX_BROKER_URL": "memory://"}


def run(env: dict[str, str], *args: str) -> Result:
    # The CLI builds its Outbox by importing relay.app, which reads OUTBOX_* at import: forget the
    # previous invocation's module so each run sees its own environment, as a new process would.
    sys.modules.pop("relay.app", None)
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def unmigrated_sqlite(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    engine = make_engine(url)
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE app_table (id INTEGER PRIMARY KEY)")  # a database, but not ours
    engine.dispose()
    return url


def stamp(url: str, revision: str) -> None:
    engine = make_engine(url)
    with engine.begin() as c:
        c.execute(sa.text("UPDATE outbox_schema_version SET version_num = :r"), {"r": revision})
    engine.dispose()


# -- outbox check --------------------------------------------------------------------------------

def test_check_passes_when_everything_is_up(env: dict[str, str]) -> None:
    r = run(env, "check")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "ready: database ok, schema ok, broker ok" and r.stderr == ""
    r = run(env, "check", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ready"] is True and doc["failed"] == []
    assert [(c["name"], c["ok"]) for c in doc["checks"]] == [("database", True), ("schema", True), ("broker", True)]


def test_check_fails_with_the_database_down(env: dict[str, str]) -> None:
    # Given a Postgres URL (with a password) on a port nothing listens on
    env = {**env, "OUTBOX_DATABASE_URL": pg_down_url()}
    # When the check runs
    r = run(env, "check")
    # Then exit 3, one line per failed check, the schema reported as not checked, no password
    assert r.exit_code == EXIT_PROBLEM, r.output
    lines = r.stderr.splitlines()
    assert [ln.split(" (")[0] for ln in lines] == ["database: unreachable", "schema: not checked: database unreachable"]
    assert PASSWORD not in r.output
    doc = json.loads(run(env, "check", "--json").stdout)
    assert doc["ready"] is False and doc["failed"] == ["database", "schema"]
    assert PASSWORD not in json.dumps(doc)


@pytest.mark.parametrize(("revision", "line"), [(None, "schema: not migrated"),
                                                ("0000_older", "schema: not at head revision")])
def test_check_fails_when_the_schema_is_not_at_head(env: dict[str, str], tmp_path: Path, sqlite_url: str,
                                                     revision: str | None, line: str) -> None:
    # Given a database that never ran 'outbox db upgrade', or one stamped at another revision
    if revision is None:
        env = {**env, "OUTBOX_DATABASE_URL": unmigrated_sqlite(tmp_path)}
    else:
        stamp(sqlite_url, revision)
    # When the check runs
    r = run(env, "check")
    # Then only the schema check fails, and it says what to run
    assert r.exit_code == EXIT_PROBLEM, r.output
    assert r.stderr.splitlines()[0].startswith(line) and "outbox db upgrade" in r.stderr
    assert len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize("scheme", ["redis", "amqp"])
def test_check_fails_with_the_broker_down(env: dict[str, str], scheme: str) -> None:
    # Given a broker URL (with a password) on a port nothing listens on
    port = closed_port()
    url = (f"redis://:{PASSWORD}@127.0.0.1:{port}/0" if scheme == "redis"
           else f"amqp://guest:{PASSWORD}@127.0.0.1:{port}//")
    env = {**env, "OUTBOX_BROKER_URL": url}
    # When the check runs
    r = run(env, "check")
    # Then exit 3 with exactly the broker line, and no password
    assert r.exit_code == EXIT_PROBLEM, r.output
    assert [ln.split(" (")[0] for ln in r.stderr.splitlines()] == ["broker: unreachable"]
    assert PASSWORD not in r.output
    # And --no-broker (a process that never publishes) passes on the same configuration
    assert run(env, "check", "--no-broker").exit_code == 0


@pytest.mark.redis
def test_check_passes_against_real_redis(env: dict[str, str], redis_url: str) -> None:
    r = run({**env, "OUTBOX_BROKER_URL": redis_url}, "check")
    assert r.exit_code == 0, r.output


@pytest.mark.rabbitmq
def test_check_passes_against_real_rabbitmq(env: dict[str, str], rabbitmq_url: str) -> None:
    r = run({**env, "OUTBOX_BROKER_URL": rabbitmq_url}, "check")
    assert r.exit_code == 0, r.output


def test_check_bad_input_is_a_usage_error(env: dict[str, str]) -> None:
    assert run(env, "check", "--timeout", "0s").exit_code == 2
    assert run(env, "check", "--timeout", "soon").exit_code == 2
    assert run({**env, "OUTBOX_DATABASE_URL": "mysql://x"}, "check").exit_code == 2


def test_version() -> None:
    r = CliRunner().invoke(cli, ["--version"])
    assert r.exit_code == 0 and r.stdout.startswith("outbox, version ")


def test_readiness_on_sqlite_and_postgres(any_sessions: sessionmaker[Session]) -> None:
    result = health.readiness(any_sessions, broker=lambda: None)
    assert result.ok, [c.line() for c in result.failed]
    assert [(c.name, c.reason) for c in result.checks] == [("database", "ok"), ("schema", "ok"), ("broker", "ok")]
    # a prefix that was never migrated in the same database is not ready
    other = health.readiness(any_sessions, prefix="other_")
    assert [(c.name, c.reason) for c in other.failed] == [("schema", "not migrated")]


def test_readiness_never_raises_on_a_failing_probe(sqlite_sessions: sessionmaker[Session]) -> None:
    # Given a broker probe that fails with something unexpected
    def probe() -> None:
        raise RuntimeError(f"boom amqp://u:{PASSWORD}@host//")

    # When readiness runs; Then it is a failed check with the password masked, not an exception
    result = health.readiness(sqlite_sessions, broker=probe)
    assert not result.ok and [c.name for c in result.failed] == ["broker"]
    assert PASSWORD not in result.failed[0].detail and "***" in result.failed[0].detail
    assert result.public_dict() == {"status": "not ready", "failed": ["broker"],
                                    "checks": {"database": "ok", "schema": "ok", "broker": "unreachable"}}


# -- /readyz and /healthz ------------------------------------------------------------------------

def client(tmp_home: Path, namespace: str, *, database_url: str, broker_url: str = "memory://") -> FlaskClient:
    settings = Settings(home=tmp_home, namespace=namespace, broker_url=broker_url, database_url=database_url)
    return create_app(settings=settings).test_client()


def test_readyz_200_when_ready(tmp_home: Path, namespace: str, sqlite_url: str) -> None:
    r = client(tmp_home, namespace, database_url=sqlite_url).get("/readyz")
    assert r.status_code == 200 and r.mimetype == "application/json"
    assert r.json == {"status": "ready", "failed": [], "checks": {"database": "ok", "schema": "ok", "broker": "ok"}}
    assert r.headers["Cache-Control"] == "no-store"


def test_readyz_503_with_the_database_down(tmp_home: Path, namespace: str) -> None:
    # Given the web app on a Postgres URL (user, password) where nothing listens
    c = client(tmp_home, namespace, database_url=pg_down_url())
    # When the orchestrator asks for readiness, and for liveness
    ready, alive = c.get("/readyz"), c.get("/healthz")
    # Then readiness is a JSON 503 naming the failed checks and nothing about the database's whereabouts
    assert ready.status_code == 503 and ready.mimetype == "application/json"
    assert ready.json is not None and ready.json["status"] == "not ready"
    assert ready.json["failed"] == ["database", "schema"] and ready.json["checks"]["broker"] == "ok"
    assert int(ready.headers["Retry-After"]) > 0
    assert_no_internals(ready.get_data(as_text=True))
    # And liveness stays 200: a database outage must not get the web process restarted
    assert alive.status_code == 200 and alive.json == {"ok": True, "status": "alive"}


def test_readyz_503_with_the_broker_down(tmp_home: Path, namespace: str, sqlite_url: str) -> None:
    # Given the broker on a port nothing listens on
    port = closed_port()
    c = client(tmp_home, namespace, database_url=sqlite_url, broker_url=f"redis://:{PASSWORD}@127.0.0.1:{port}/0")
    # When readiness is asked; Then 503 naming only the broker, without host, port or password
    r = c.get("/readyz")
    assert r.status_code == 503 and r.json is not None
    assert r.json["failed"] == ["broker"] and r.json["checks"]["broker"] == "unreachable"
    assert_no_internals(r.get_data(as_text=True), str(port), "redis://")


def test_readyz_503_when_not_migrated(tmp_home: Path, namespace: str, tmp_path: Path) -> None:
    # Given a reachable database without the outbox tables; When readiness is asked; Then 503 for the schema
    r = client(tmp_home, namespace, database_url=unmigrated_sqlite(tmp_path)).get("/readyz")
    assert r.status_code == 503 and r.json is not None
    assert r.json["failed"] == ["schema"] and r.json["checks"]["schema"] == "not migrated"


# -- outbox stats thresholds ---------------------------------------------------------------------

@pytest.fixture
def sessions(sqlite_url: str) -> sessionmaker[Session]:
    return make_session_factory(make_engine(sqlite_url))


def test_stats_thresholds_pass_on_a_clean_outbox(env: dict[str, str], sessions: sessionmaker[Session],
                                                 tables: Tables) -> None:
    # Given a pending row 10 minutes old and no dead letter
    with sessions() as s:
        outbox_row(s, tables=tables, created_at_ms=SystemClock().now_ms() - 10 * 60_000)
    # When stats runs with both thresholds set above what is there; Then exit 0
    r = run(env, "stats", "--fail-on-dead-letters", "--max-pending-age", "1h")
    assert r.exit_code == 0, r.output
    assert r.stderr == ""


def test_stats_thresholds_set_the_exit_code(env: dict[str, str], sessions: sessionmaker[Session],
                                            tables: Tables) -> None:
    # Given a consumer dead letter and a pending outbox row two hours old
    now = SystemClock().now_ms()
    with sessions() as s:
        consumer_dead_letter(s, tables=tables, consumer="shipping", env=envelope("o-1"), failed_at_ms=now - 60_000)
        outbox_row(s, tables=tables, created_at_ms=now - 2 * HOUR)
    # When stats runs without a threshold; Then it reports and exits 0 (as before)
    assert run(env, "stats").exit_code == 0
    # When the dead-letter threshold is asked for; Then exit 3 and one line saying why
    r = run(env, "stats", "--fail-on-dead-letters")
    assert r.exit_code == EXIT_PROBLEM, r.output
    assert r.stderr.startswith("threshold crossed: 1 unreplayed dead letter(s)") and len(r.stderr.splitlines()) == 1
    assert "dead letters: 1" in r.stdout  # the report is still printed
    # When the pending-age threshold is under the oldest row's age; Then exit 3, and not when it is over
    r = run(env, "stats", "--max-pending-age", "1h")
    assert r.exit_code == EXIT_PROBLEM and "oldest pending outbox row is 2h" in r.stderr
    assert run(env, "stats", "--max-pending-age", "3h").exit_code == 0
    # When both are crossed with --json; Then stdout is still one JSON document, naming both
    r = run(env, "stats", "--json", "--fail-on-dead-letters", "--max-pending-age", "30m")
    assert r.exit_code == EXIT_PROBLEM and len(r.stderr.splitlines()) == 2
    doc = json.loads(r.stdout)
    assert [(t["name"], t["crossed"]) for t in doc["thresholds"]] == [("dead_letters", True),
                                                                     ("max_pending_age_ms", True)]
    assert doc["thresholds"][1]["limit"] == 30 * 60_000 and doc["thresholds"][1]["value"] >= 2 * HOUR


def test_stats_with_the_database_down_is_an_error_not_a_threshold(env: dict[str, str]) -> None:
    # Given the database down; When a cron job asks for the thresholds
    r = run({**env, "OUTBOX_DATABASE_URL": pg_down_url()}, "stats", "--fail-on-dead-letters")
    # Then exit 1 (the command failed), distinct from 3 (a threshold crossed), in one line without the password
    assert r.exit_code == 1, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and PASSWORD not in r.output


def test_stats_bad_duration_is_a_usage_error(env: dict[str, str]) -> None:
    r = run(env, "stats", "--max-pending-age", "5 minutes")
    assert r.exit_code == 2 and "is not a duration" in r.stderr
