"""The "Running it for real" block (docs/deployment.md, linked from the README), run as written against a
fresh home directory.

The commands are read from the page itself, so a command that changes there is the command tested
here. Only the values of the ``export`` line are replaced (its example hosts do not exist) by a fresh,
unmigrated Postgres database and Redis; the namespace is unique (``OUTBOX_NAMESPACE``) so parallel
runs share no queue, ``OUTBOX_HOME`` is a directory that does not exist yet, and gunicorn's own
``GUNICORN_CMD_ARGS`` picks a free port. Each long-running command must become ready the way an
operator would check it (the worker answers ``celery inspect ping``, beat writes its schedule, the
relay logs that its loop started, gunicorn answers ``/healthz``); then one order placed over HTTP
must take effect in all four consumers, and every process must stop on SIGTERM.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.relay import lease
from celery_outbox.schema import define_tables
from consumers.effects import effect_counts
from devtools.processes import Child, wait_until
from tests.conftest import scratch_database

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's celery, outbox, gunicorn, python
PAGE = ROOT / "docs" / "deployment.md"
SECTION = "# Running it for real"
EXPECTED = ["python", "celery", "celery", "outbox", "gunicorn"]  # the programs of the block, in order


def readme_block() -> tuple[dict[str, str], list[list[str]]]:
    """The ``export`` line's variables and every other command of the page's first bash block."""
    text = PAGE.read_text()
    section = text[text.index(SECTION):]
    body = section[section.index("```bash\n") + len("```bash\n"):]
    body = body[:body.index("```")]
    exports: dict[str, str] = {}
    commands: list[list[str]] = []
    for line in body.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] == "export":
            for word in words[1:]:
                key, _, value = word.partition("=")
                exports[key] = value
        else:
            commands.append(words)
    return exports, commands


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def fresh_database() -> Iterator[str]:
    """An empty Postgres database (not migrated: the page's db-upgrade does that); dropped after."""
    with scratch_database("outbox_readme") as url:
        yield url


def http(method: str, url: str, body: dict[str, object] | None = None) -> tuple[int, dict[str, object]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def answers(url: str) -> bool:
    try:
        return http("GET", url)[0] == 200
    except OSError:
        return False


def test_the_readme_commands_run_as_written(fresh_database: str, redis_url: str, namespace: str,
                                            tmp_path: Path) -> None:
    exports, commands = readme_block()
    # Given the page's block: one export line naming the database and the broker, then the commands
    assert set(exports) == {"OUTBOX_DATABASE_URL", "OUTBOX_BROKER_URL"}, exports
    assert [c[0] for c in commands] == EXPECTED, commands
    upgrade, *services = commands
    home = tmp_path / "fresh-home"  # does not exist: beat must create it
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "GUNICORN_"))}
    env.update({"OUTBOX_DATABASE_URL": fresh_database, "OUTBOX_BROKER_URL": redis_url,
                "OUTBOX_NAMESPACE": namespace, "OUTBOX_HOME": str(home), "PYTHONUNBUFFERED": "1",
                "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "GUNICORN_CMD_ARGS": f"--bind 127.0.0.1:{port}"})

    # When the one-shot command runs, it migrates the empty database
    done = subprocess.run(upgrade, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "database upgraded" in done.stdout and "postgres@" not in done.stdout  # no credentials echoed

    children = [Child(name=f"{i}-{argv[0]}", argv=argv, env=env, log_path=tmp_path / "logs" / f"{i}-{argv[0]}.log",
                      cwd=ROOT) for i, argv in enumerate(services)]
    worker, beat, relay, web = children
    engine = make_engine(fresh_database)
    sessions = make_session_factory(engine)
    tables = define_tables()

    def logs() -> str:
        return "\n".join(f"--- {c.name} ({' '.join(c.argv)}):\n{c.log_tail(60)}" for c in children)

    def worker_pong() -> bool:
        ping = subprocess.run([str(BIN / "celery"), "-A", "relay.app", "inspect", "ping", "-t", "2", "-j",
                               "-d", f"celery@{socket.gethostname()}"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        return ping.returncode == 0 and "pong" in ping.stdout

    try:
        for child in children:
            child.start()
        # Then each long-running one becomes ready, as an operator would check it
        assert wait_until(lambda: worker.alive and worker_pong(), timeout_s=120, interval_s=1), logs()
        assert wait_until(lambda: beat.alive and any(home.glob("celerybeat-schedule*")), timeout_s=60), logs()
        assert wait_until(lambda: relay.alive and "relay loop started" in relay.log_tail(200), timeout_s=60), logs()
        base = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: web.alive and answers(f"{base}/healthz"), timeout_s=60), logs()
        assert all(c.alive for c in children), logs()

        # When one order is placed over HTTP
        order_id = f"readme-{uuid.uuid4().hex[:12]}"
        status, order = http("POST", f"{base}/orders", {
            "order_id": order_id, "customer_id": "c-1", "email": "readme@example.com",
            "lines": [{"sku": "sku-1", "quantity": 2, "unit_price_cents": 1250}]})
        assert status == 201, (order, logs())

        # Then it takes effect once in each of the three consumers, and its confirmation e-mail task sends one e-mail
        def effects() -> dict[str, int]:
            with sessions() as s:
                return effect_counts(s)
        assert wait_until(lambda: effects() == {"shipping": 1, "billing": 1, "search": 1, "email": 1},
                          timeout_s=120, interval_s=0.5), (effects(), logs())
        assert http("GET", f"{base}/orders/{order_id}")[0] == 200
        # And the reconciler and retention ran where the relay runs (beat's worker or `outbox relay`)
        with sessions() as s:
            due = {job: lease.next_due_ms(s, job, tables=tables) for job in (lease.RECONCILE, lease.PRUNE)}
        assert all(v is not None for v in due.values()), (due, logs())
        with sessions() as s:
            assert s.scalar(sa.select(sa.func.count()).select_from(tables.outbox)
                            .where(tables.outbox.published_at_ms.is_(None))) == 0
        assert all(c.alive for c in children), logs()
    finally:
        codes = {c.name: c.stop(timeout_s=30) for c in reversed(children)}
        engine.dispose()
        _forget_queues(redis_url, namespace)
    # And every process stopped on SIGTERM, cleanly
    assert codes == {c.name: 0 for c in children}, (codes, logs())
    # Nothing printed a traceback one character per log line (or at all)
    for child in children:
        text = child.log_path.read_text(errors="replace")
        assert "Traceback" not in text, child.log_tail(80)


def _forget_queues(redis_url: str, namespace: str) -> None:
    """Best effort: drop this run's queues and bindings from the shared Redis."""
    try:
        import redis

        client = redis.Redis.from_url(redis_url)
        keys = [*client.scan_iter(f"{namespace}.*"), *client.scan_iter(f"_kombu.binding*.{namespace}.*")]
        if keys:
            client.delete(*keys)
        client.close()
    except Exception:  # cleanup only
        pass


def test_beat_that_cannot_make_its_state_directory_says_so_in_one_line(tmp_path: Path) -> None:
    # Given a home whose parent is a file, so its directory can never be created
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({"OUTBOX_HOME": str(blocker / "home"), "OUTBOX_BROKER_URL": "memory://",
                "OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite'}", "PYTHONUNBUFFERED": "1"})
    # When the page's beat command starts
    done = subprocess.run([str(BIN / "celery"), "-A", "relay.app", "beat"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    # Then it stops with one line naming the directory, not a traceback one character per log line
    assert done.returncode != 0, out
    said = [line for line in out.splitlines() if "cannot create" in line]
    assert len(said) == 1 and str(blocker / "home") in said[0], out
    assert "Traceback" not in out and len(out.splitlines()) < 20, out
