"""Child processes the demo and the chaos harness run: real ``celery worker``/``celery beat``.

Each child gets its settings through ``OUTBOX_*`` variables and writes its log to a file, so a
failing run can show what a worker said.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from celeryconfig import Settings


def settings_env(settings: Settings, *, broker_url: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment that makes a child build the same ``Settings`` (broker already resolved)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(settings.replace(database_url=settings.effective_database_url, broker_url=broker_url).to_env())
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


class Child:
    """A subprocess with a log file; ``stop()`` asks politely (SIGTERM), then insists (SIGKILL)."""

    def __init__(self, *, name: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path,
                 cwd: Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = log_path
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     cwd=self.cwd, start_new_session=True)
        log.close()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group (a prefork worker's children too)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, *, timeout_s: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        # Reap any stragglers left in the group (prefork children).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def celery_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "relay.app", *args]


def worker(settings: Settings, *, broker_url: str, log_dir: Path, queues: Sequence[str], name: str = "worker",
           concurrency: int = 2, pool: str = "prefork", extra_env: Mapping[str, str] | None = None) -> Child:
    argv = celery_argv(
        "worker", "-Q", ",".join(queues), "-c", str(concurrency), "-P", pool, "-E",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "-n", f"{name}@%h", "-l", "INFO",
    )
    return Child(name=name, argv=argv, env=settings_env(settings, broker_url=broker_url, extra=extra_env),
                 log_path=log_dir / f"{name}.log")


def beat(settings: Settings, *, broker_url: str, log_dir: Path, name: str = "beat") -> Child:
    argv = celery_argv("beat", "-s", str((settings.home / f"{name}-schedule").resolve()), "-l", "INFO")
    return Child(name=name, argv=argv, env=settings_env(settings, broker_url=broker_url),
                 log_path=log_dir / f"{name}.log")


def wait_until(predicate: Callable[[], bool], *, timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll ``predicate()`` until true or the deadline passes (a wait, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
