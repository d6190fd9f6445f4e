"""Secrets never leave the process: a real ``celery -A relay.app worker`` started with a database URL
and a broker URL that carry passwords, and an admin token, answers ``inspect conf`` (to anyone who can
publish to the broker), ``inspect report`` and ``inspect stats``, and ``celery report`` prints the
configuration; none of them, nor the worker's own log, shows a password or the token.

Postgres (trust authentication) ignores the password, Redis without ``requirepass`` accepts one, and
RabbitMQ's ``guest`` has the password ``guest``: there the check is that no ``:guest@`` and no
``password ... guest`` appears (Celery masks it as ``guest:********@``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.workers import start_worker, stop_worker

pytestmark = [pytest.mark.postgres, pytest.mark.workers, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))
DB_PASSWORD = f"dbPw{uuid.uuid4().hex[:12]}"
REDIS_PASSWORD = f"redisPw{uuid.uuid4().hex[:12]}"
ADMIN_TOKEN = f"adminTok{uuid.uuid4().hex[:12]}"


@dataclass
class Deployment:
    env: dict[str, str]
    node: str
    secrets: tuple[str, ...]  # text that must appear nowhere
    leak_patterns: tuple[re.Pattern[str], ...]  # shapes of a leaked password that is also a user name
    log: Path
    proc: subprocess.Popen[bytes]

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-6000:] if self.log.exists() else ""


def with_password(url: str, password: str) -> str:
    scheme, _, rest = url.partition("://")
    host = rest.rsplit("@", 1)[-1]
    user = rest.rsplit("@", 1)[0].split(":")[0] if "@" in rest else ""
    return f"{scheme}://{user}:{password}@{host}"


@pytest.fixture(params=["redis", "rabbitmq"])
def deployment(request: pytest.FixtureRequest, pg_url: str, namespace: str, tmp_path: Path) -> Iterator[Deployment]:
    if request.param == "redis":
        redis_url: str = request.getfixturevalue("redis_url")
        broker = with_password(redis_url.rsplit("/", 1)[0] + "/5", REDIS_PASSWORD)
        secrets: tuple[str, ...] = (DB_PASSWORD, REDIS_PASSWORD, ADMIN_TOKEN)
        patterns: tuple[re.Pattern[str], ...] = ()
    else:
        broker = request.getfixturevalue("rabbitmq_url")  # guest:guest
        assert ":guest@" in broker, "this test expects RabbitMQ's guest user"
        secrets = (DB_PASSWORD, ADMIN_TOKEN)
        patterns = (re.compile(r":guest@"), re.compile(r"password\W{1,6}guest", re.IGNORECASE))
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({"OUTBOX_DATABASE_URL": with_password(pg_url, DB_PASSWORD), "OUTBOX_BROKER_URL": broker,
                "OUTBOX_ADMIN_TOKEN": ADMIN_TOKEN, "OUTBOX_NAMESPACE": namespace, "OUTBOX_HOME": str(home)})
    node = f"secrets-{namespace}@{os.uname().nodename}"
    log = tmp_path / "worker.log"
    proc = start_worker(env=env, queues=[f"{namespace}.shipping"], node=node, log=log, pool="solo")
    d = Deployment(env=env, node=node, secrets=secrets, leak_patterns=patterns, log=log, proc=proc)
    try:
        yield d
    finally:
        stop_worker(proc)


def celery(d: Deployment, *args: str) -> str:
    out = subprocess.run([CELERY, "-A", "relay.app", *args], cwd=ROOT, env=d.env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, f"celery {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}\n{d.logs()}"
    return out.stdout + out.stderr


def wait_until_the_worker_answers(d: Deployment, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            pytest.fail(f"worker exited with {d.proc.returncode}\n{d.logs()}")
        out = subprocess.run([CELERY, "-A", "relay.app", "inspect", "ping", "-d", d.node, "-t", "2"], cwd=ROOT,
                             env=d.env, capture_output=True, text=True, timeout=60)
        if out.returncode == 0 and d.node in out.stdout:
            return
        time.sleep(0.5)
    pytest.fail(f"worker {d.node} never answered ping\n{d.logs()}")


def assert_no_secret(what: str, text: str, d: Deployment) -> None:
    for secret in d.secrets:
        assert secret not in text, f"{what} shows a secret:\n{text[:4000]}"
    for pattern in d.leak_patterns:
        assert not pattern.search(text), f"{what} shows the broker password ({pattern.pattern}):\n{text[:4000]}"


def test_inspect_and_report_show_no_password_or_token(deployment: Deployment) -> None:
    d = deployment
    # Given a real worker whose database URL, broker URL and admin token carry secrets
    wait_until_the_worker_answers(d)
    # When anyone on the broker asks it for its configuration (with and without Celery's defaults),
    # its bug report and its stats, and when `celery report` prints the local configuration
    answers = {
        "inspect conf": celery(d, "inspect", "conf", "-d", d.node, "-t", "10", "--json"),
        "inspect conf (with defaults)": celery(d, "inspect", "conf", "true", "-d", d.node, "-t", "10", "--json"),
        "inspect report": celery(d, "inspect", "report", "-d", d.node, "-t", "10", "--json"),
        "inspect stats": celery(d, "inspect", "stats", "-d", d.node, "-t", "10", "--json"),
        "celery report": celery(d, "report"),
    }
    # Then each answer is really the configuration (the broker URL is there, masked)...
    assert d.node in answers["inspect conf"] and "broker_url" in answers["inspect conf"]
    assert "broker_url" in answers["celery report"] and "********" in answers["celery report"]
    assert "task_queues" in answers["inspect conf (with defaults)"]
    # ...and none shows a password or the token, nor does the worker's log
    for what, text in answers.items():
        assert_no_secret(what, text, d)
    assert_no_secret("the worker log", d.logs(), d)
    assert d.proc.poll() is None, d.logs()
