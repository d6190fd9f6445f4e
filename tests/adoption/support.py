"""Running an adopting project's own commands from its own directory, as its team would."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.workers import stop_process

BIN = Path(sys.executable).parent


def run(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    """Run one command; its output, or a failure showing what it printed."""
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{argv}: {out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out.stdout


@contextmanager
def celery_worker(app: str, *, cwd: Path, env: dict[str, str], log_path: Path,
                  pool: tuple[str, ...] = ("-P", "solo")) -> Iterator[subprocess.Popen[bytes]]:
    """A real ``celery -A app worker`` (solo pool unless ``pool`` says otherwise), stopped (then killed) on exit."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(BIN / "celery"), "-A", app, "worker", *pool, "-l", "INFO",
                                 "--without-gossip", "--without-mingle", "--without-heartbeat"],
                                cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            stop_process(proc, timeout_s=20, group=False)
