"""Real ``celery -A relay.app worker`` processes for tests: started in their own session, stopped for sure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).parent / "celery")
# What a worker logs when Flower's periodic ``enable_events`` broadcast turns on the task events its own
# configuration left off (celery/worker/control.py, enable_events; docs/operations.md).
TASK_EVENTS_BY_REMOTE = "Events of group {task} enabled by remote."


def start_worker(*, env: Mapping[str, str], queues: Sequence[str], node: str, log: Path, pool: str = "prefork",
                 concurrency: int = 2, app: str = "relay.app", extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """A worker of the reference deployment (or of ``app``) consuming ``queues``, its output in ``log``;
    ``extra``: more worker options (``-E``)."""
    argv = [CELERY, "-A", app, "worker", "-Q", ",".join(queues), "-P", pool,
            *(["-c", str(concurrency)] if pool == "prefork" else []), *extra,
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO", "-n", node]
    with log.open("wb") as out:
        return subprocess.Popen(argv, cwd=ROOT, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the worker's whole process group (warm shutdown), SIGKILL it if it does not stop."""
    stop_process(proc)


def stop_process(proc: subprocess.Popen[bytes], *, timeout_s: float = 15.0, group: bool = True) -> None:
    """SIGTERM ``proc`` (its whole process group when ``group``: it was started in a session of its own),
    SIGKILL if it has not stopped within ``timeout_s``."""
    if proc.poll() is not None:
        return
    if group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait(timeout=10)
