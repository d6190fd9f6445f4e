"""A bad configuration is one clean line at every entry point, never a traceback.

Each entry point of the reference deployment is started for real, as a user would, with a bad
``OUTBOX_*`` variable: ``celery -A relay.app worker`` and ``beat``, ``gunicorn relay.wsgi:app``,
``outbox`` and ``python -m devtools``. Each must exit non-zero with a ``bad configuration: ...`` line
naming the variable, no ``Traceback``, and no password from the bad value; gunicorn's master must stop
(not start workers again for ever).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PASSWORD = "hunter2secretpw"

ENTRY_POINTS: dict[str, list[str]] = {
    "celery worker": [str(BIN / "celery"), "-A", "relay.app", "worker", "-P", "solo", "--without-gossip",
                      "--without-mingle", "--without-heartbeat"],
    "celery beat": [str(BIN / "celery"), "-A", "relay.app", "beat"],
    "gunicorn": [str(BIN / "gunicorn"), "--bind", "127.0.0.1:0", "--workers", "1", "relay.wsgi:app"],
    "outbox": [str(BIN / "outbox"), "stats"],
    "devtools": [sys.executable, "-m", "devtools", "db-upgrade"],
}

BAD: dict[str, tuple[dict[str, str], str]] = {
    # (environment, the variable the line must name)
    "nan poll interval": ({"OUTBOX_RELAY_POLL_INTERVAL_S": "nan"}, "OUTBOX_RELAY_POLL_INTERVAL_S"),
    "negative redelivery window": ({"OUTBOX_BROKER_REDELIVERY_WINDOW_MS": "-1"}, "OUTBOX_BROKER_REDELIVERY_WINDOW_MS"),
    "int past 2^63": ({"OUTBOX_RELAY_BATCH_SIZE": str(2**63)}, "OUTBOX_RELAY_BATCH_SIZE"),
    "bad consumer name in a route": ({"OUTBOX_ROUTES": "OrderPlaced=ship ping"}, "OUTBOX_ROUTES"),
    "time limit past the visibility timeout (Redis)": (
        {"OUTBOX_CONSUMER_TIME_LIMIT_S": "400", "OUTBOX_BROKER_URL": "redis://127.0.0.1:1/0"},
        "OUTBOX_CONSUMER_TIME_LIMIT_S"),
    "database URL with a password and a bad port": (
        {"OUTBOX_DATABASE_URL": f"postgresql://app:{PASSWORD}@db:99999/app"}, "OUTBOX_DATABASE_URL"),
    # accepted before, then every order answered 400 (the web app reported ready)
    "a consumer twice in a route, a route twice": (
        {"OUTBOX_ROUTES": "OrderPlaced=shipping,shipping;OrderPlaced=billing"}, "OUTBOX_ROUTES"),
    "a crash point with a malformed count": ({"OUTBOX_CRASH_POINTS": "after_mark@abc"}, "OUTBOX_CRASH_POINTS"),
    "an admin token too short to guard anything": ({"OUTBOX_ADMIN_TOKEN": PASSWORD[:9]}, "OUTBOX_ADMIN_TOKEN"),
}


def run(entry: str, env_changes: dict[str, str], tmp_path: Path,
        args: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({"OUTBOX_HOME": str(tmp_path / "var"), "OUTBOX_BROKER_URL": "memory://", "OUTBOX_APP": "relay.app",
                **env_changes})
    argv = ENTRY_POINTS[entry] if args is None else [ENTRY_POINTS[entry][0], *args]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_bad_configuration_is_one_line_at_every_entry_point(entry: str, bad: str, tmp_path: Path) -> None:
    env, variable = BAD[bad]
    # Given a bad OUTBOX_* variable, When the entry point starts
    proc = run(entry, env, tmp_path)
    output = proc.stdout + proc.stderr
    # Then it exits non-zero (and gunicorn's master stops with "App failed to load", status 4)
    assert proc.returncode != 0, output
    if entry == "gunicorn":
        assert proc.returncode == 4, output
    # And stderr has one line saying so and naming the variable, with no traceback and no password
    lines = [line for line in proc.stderr.splitlines() if "bad configuration: " in line]
    assert len(lines) == 1 and variable in lines[0], output
    assert "Traceback" not in output and PASSWORD not in output and PASSWORD[:9] not in output, output


def test_routes_to_an_unknown_consumer_stop_the_worker_at_import_in_one_line(tmp_path: Path) -> None:
    # Given a route the settings accept but the deployment's consumers do not declare
    proc = run("celery worker", {"OUTBOX_ROUTES": "OrderPlaced=ghost"}, tmp_path)
    # Then the worker does not start, with one line naming the route and no traceback
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("bad configuration: ")]
    assert len(lines) == 1 and "OUTBOX_ROUTES" in lines[0] and "'ghost'" in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_importing_the_wsgi_module_with_a_sqlite_file_it_cannot_create_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # Given a SQLite URL whose directory cannot be made (the web app builds its engine at import)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({"OUTBOX_HOME": str(tmp_path / "var"), "OUTBOX_BROKER_URL": "memory://",
                "OUTBOX_DATABASE_URL": "sqlite:////proc/nope/x.db"})
    # When the module is imported outside gunicorn (a 23-line traceback before)
    proc = subprocess.run([sys.executable, "-c", "import relay.wsgi"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    # Then one line naming the variable and exit 2 (a bad configuration, as in the outbox CLI), no traceback
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "OUTBOX_DATABASE_URL" in proc.stderr
    assert proc.stderr.startswith("bad configuration: ") and "Traceback" not in proc.stdout + proc.stderr


def test_a_good_configuration_still_imports(tmp_path: Path) -> None:
    # Given a valid configuration, the same modules import (the guard is not a blanket exit)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({"OUTBOX_HOME": str(tmp_path / "var"), "OUTBOX_BROKER_URL": "memory://"})
    code = "import relay.app, relay.wsgi; print(relay.app.outbox.settings.namespace, relay.wsgi.app.name)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["outbox", "orders"], proc.stderr


@pytest.mark.parametrize("entry", ["celery worker", "celery beat", "gunicorn"])
def test_an_embedded_broker_that_is_not_running_is_one_line(entry: str, tmp_path: Path) -> None:
    # Given the default embedded broker, which nothing started (the app never starts one on import)
    proc = run(entry, {"OUTBOX_BROKER_URL": "embedded"}, tmp_path)
    output = proc.stdout + proc.stderr
    # Then the process stops with one line that says how to start it, and no traceback
    assert proc.returncode != 0, output
    lines = [line for line in proc.stderr.splitlines() if "bad configuration: " in line]
    assert len(lines) == 1 and "embedded-redis start" in lines[0], output
    assert "Traceback" not in output
    # and no redis-server was left behind under the home directory
    assert not (tmp_path / "var" / "redis" / "redis.pid").exists()


@pytest.mark.parametrize("commands", [
    [["db", "upgrade"], ["db", "current"], ["db", "check"], ["stats", "--json"], ["dead-letters", "list"],
     ["prune", "--published-older-than", "1d"]],
])
def test_database_commands_run_without_the_embedded_broker(commands: list[list[str]], tmp_path: Path) -> None:
    # Given the default embedded broker, which nothing started, and a SQLite database
    for args in commands:
        # When a command that only touches the database runs
        proc = run("outbox", {"OUTBOX_BROKER_URL": "embedded"}, tmp_path, args=args)
        # Then it succeeds: no broker is looked for
        assert proc.returncode == 0, (args, proc.stdout + proc.stderr)
    # And a command that needs the broker still says how to start it, in one line, exit 2
    for args in (["relay", "--once"], ["check"]):
        proc = run("outbox", {"OUTBOX_BROKER_URL": "embedded"}, tmp_path, args=args)
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0 and "embedded-redis start" in output and "Traceback" not in output, (args, output)
    assert not (tmp_path / "var" / "redis" / "redis.pid").exists()
