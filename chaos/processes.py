"""Real subprocesses a chaos run starts, SIGKILLs and restarts: the order writer, relays, workers.

Each runs in a session of its own (so a prefork worker's children go with it), logs to a file the
report can point at, and takes its settings only through ``OUTBOX_*`` environment variables, the
way a deployment would. A crash point is armed by starting the process with
``OUTBOX_CRASH_POINTS=name@N``; a process that then exits by SIGKILL died exactly there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path(sys.executable).parent


@dataclass(kw_only=True)
class ManagedProcess:
    """One role (``relay``, ``worker``, ``orders``) whose successive incarnations we track."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str]
    log_dir: Path
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    armed: str = ""
    sigkills: list[str] = field(default_factory=list)  # crash-point spec of each incarnation killed
    frozen_pid: int | None = None  # the incarnation ``freeze`` stopped

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self, *, crash_points: str = "", extra_env: Mapping[str, str] | None = None) -> None:
        """Start a new incarnation, optionally armed with ``crash_points`` (``name@N``)."""
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env, **(extra_env or {}), "OUTBOX_CRASH_POINTS": crash_points}
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.incarnation += 1
        self.armed = crash_points
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {self.name} incarnation {self.incarnation} armed={crash_points or '-'} ===\n".encode())
            log.flush()
            self.proc = subprocess.Popen(list(self.argv), env=env, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.cwd, start_new_session=True)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def reap(self) -> int | None:
        """If the current incarnation has exited, record how; returns its exit code (or None)."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            return None
        if code == -signal.SIGKILL:
            self.sigkills.append(self.armed)
        self._kill_group()
        self.proc = None
        return code

    def wait_exit(self, *, timeout_s: float) -> int | None:
        """Wait for the current incarnation to exit by itself; None if it still runs."""
        if self.proc is None:
            return None
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        return self.reap()

    def _kill_group(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def freeze(self) -> bool:
        """SIGSTOP the incarnation's whole process group (it holds whatever it was doing); False if
        nothing runs. ``thaw`` resumes it."""
        done = self._signal_group(signal.SIGSTOP)
        if done:
            self.frozen_pid = self.pid
        return done

    def thaw(self) -> bool:
        self.frozen_pid = None
        return self._signal_group(signal.SIGCONT)

    @property
    def is_frozen(self) -> bool:
        """This incarnation was stopped by ``freeze`` and not thawed since (a restarted one is not)."""
        return self.frozen_pid is not None and self.frozen_pid == self.pid

    def _signal_group(self, sig: int) -> bool:
        if not self.alive() or self.proc is None:
            return False
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def kill(self) -> None:
        """SIGKILL the incarnation and its children (prefork pool) at whatever it was doing."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self._kill_group()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self, *, timeout_s: float = 20.0) -> None:
        """Graceful stop (SIGTERM: Celery's warm shutdown, the relay's clean exit), SIGKILL if it hangs."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        self.kill()

    def restart(self, *, crash_points: str = "") -> None:
        self.reap()
        if self.alive():
            self.stop()
        self.proc = None
        self.start(crash_points=crash_points)

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def relay_argv(*, app: str = "relay.app") -> list[str]:
    return [str(BIN / "outbox"), "-A", app, "relay"]


def worker_argv(*, queues: Sequence[str], pool: str = "solo", concurrency: int = 1,
                app: str = "relay.app", hostname: str = "chaos") -> list[str]:
    return [str(BIN / "celery"), "-A", app, "worker", "-Q", ",".join(queues), "-P", pool,
            "-c", str(concurrency), "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-n", f"{hostname}@%h", "--loglevel", "INFO"]


def beat_argv(*, schedule: Path, app: str = "relay.app") -> list[str]:
    return [str(BIN / "celery"), "-A", app, "beat", "-s", str(schedule), "--loglevel", "INFO"]


def orders_argv(*, plan: Path, interval_ms: int) -> list[str]:
    return [sys.executable, "-m", "chaos.load", "--plan", str(plan), "--interval-ms", str(interval_ms)]


@contextlib.contextmanager
def frozen(procs: Iterable[ManagedProcess]) -> Iterator[list[ManagedProcess]]:
    """SIGSTOP ``procs`` (those alive) for the duration of the block, SIGCONT them after, whatever happens."""
    stopped = [p for p in procs if p.freeze()]
    try:
        yield stopped
    finally:
        for p in stopped:
            p.thaw()


class ProcessGroup:
    """Every process a run started, so teardown can kill each one by its own id."""

    def __init__(self) -> None:
        self.members: list[ManagedProcess] = []

    def add(self, proc: ManagedProcess) -> ManagedProcess:
        self.members.append(proc)
        return proc

    def kill_all(self) -> None:
        for p in self.members:
            p.kill()

    def stop_all(self, *, timeout_s: float = 20.0) -> None:
        for p in self.members:
            p.stop(timeout_s=timeout_s)
