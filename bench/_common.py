"""Shared plumbing for the bench scripts: a throwaway Postgres database, timing, JSON results.

Benchmarks are plain scripts, not tests: they print figures and ratios and write
``bench/results/<name>.json``; nothing asserts on speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

import sqlalchemy as sa

from celery_outbox.db import make_engine
from orders import migrate

W = TypeVar("W", bound="BenchWorker")

PG_ADMIN_URL = os.environ.get("OUTBOX_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RESULTS = Path(__file__).resolve().parent / "results"
# The Postgres drivers a bench can run on (the library's [psycopg2] and [psycopg] extras). psycopg 3 prepares a
# statement on the server after it ran 5 times on a connection (its default ``prepare_threshold``); psycopg2 never.
DRIVERS = ("psycopg2", "psycopg")


def driver_url(url: str, driver: str | None) -> str:
    """``url`` on the Postgres ``driver`` (``postgresql+<driver>://``); ``None`` leaves it as it is (a plain
    ``postgresql://`` is the installed driver, psycopg2 first: ``db.normalize_url``)."""
    if driver is None:
        return url
    return sa.make_url(url).set(drivername=f"postgresql+{driver}").render_as_string(hide_password=False)


def add_driver_option(parser: argparse.ArgumentParser) -> None:
    """``--driver``: the Postgres driver of every process of the bench, the outbox's and its plain twin's alike,
    so a ratio compares the two on one driver."""
    parser.add_argument("--driver", choices=DRIVERS, default=None,
                        help="Postgres driver of every process (default: the installed one, psycopg2 first)")


@contextmanager
def fresh_database(prefix: str = "outbox_bench", *, driver: str | None = None) -> Iterator[str]:
    """A database of its own (``<prefix>_<hex>``) with the library's and the Orders service's tables, dropped
    afterwards; its URL names ``driver`` (``driver_url``)."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = make_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = driver_url(sa.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False), driver)
    try:
        migrate.upgrade(url)
        yield url
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def summary_ms(samples_s: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples_s]
    return {"n": len(ms), "mean_ms": round(statistics.fmean(ms), 4), "p50_ms": round(percentile(ms, 50), 4),
            "p95_ms": round(percentile(ms, 95), 4), "p99_ms": round(percentile(ms, 99), 4)}


def write_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"bench": name, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": {"python": platform.python_version(), "cpus": os.cpu_count()}, **data}
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path}")
    return path


class BenchWorker(Protocol):
    """What ``wait_until`` and ``consuming`` need of a bench's worker process (bench/consumer_cpu.py's ``Worker``)."""

    mode: str
    queue: str
    log: Path
    proc: subprocess.Popen[bytes]

    def stop(self) -> None: ...


def wait_until(what: str, check: Callable[[], bool], worker: BenchWorker, timeout_s: float = 300) -> None:
    """Poll ``check`` until it holds; exit with the worker's log tail if it dies or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if worker.proc.poll() is not None:
            raise SystemExit(f"{worker.mode} worker exited:\n{worker.log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}:\n{worker.log.read_text(errors='replace')[-4000:]}")


@contextmanager
def consuming(started: Mapping[str, W], *, broker_url: str, queues: Sequence[str],
              exchanges: Sequence[str]) -> Iterator[Mapping[str, W]]:
    """Workers started side by side: yields them once each consumes its queue; then stops them and deletes
    the bench's ``queues`` and ``exchanges`` from the broker."""
    from kombu import Connection

    try:
        with Connection(broker_url) as conn:
            channel = conn.channel()
            for w in started.values():
                def consumed(w: W = w) -> bool:
                    try:
                        return bool(channel.queue_declare(w.queue, passive=True).consumer_count >= 1)
                    except Exception:  # not declared yet (404 closes the channel)
                        return False
                wait_until(f"{w.mode} worker consuming", consumed, w, timeout_s=60)
        yield started
    finally:
        for w in started.values():
            w.stop()
        with Connection(broker_url) as conn:
            channel = conn.channel()
            for name in queues:
                channel.queue_delete(name)
            for name in exchanges:
                channel.exchange_delete(name)


class LineClient:
    """A bench's client subprocess (``start_new_session``) and its line protocol: the bench writes one command
    line on its stdin, the client answers one JSON line on its stdout (``"errors"``: a list, empty when it
    went well); ``quit`` ends it. Its stderr goes to ``log``. Used by bench/sweep.py and bench/saturated.py."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, *, cwd: Path) -> None:
        self._log = log.open("ab")
        self.log = log
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, start_new_session=True)

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"client exited:\n{self.log.read_text(errors='replace')[-4000:]}")
        return line

    def wait_ready(self) -> None:
        """For a client that prints ``ready`` once it has built its sending side."""
        if self._line().strip() != "ready":
            raise RuntimeError(f"client did not start:\n{self.log.read_text(errors='replace')[-4000:]}")

    def request(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        out: dict[str, Any] = json.loads(self._line())
        if out["errors"]:
            raise RuntimeError(f"client errors ({command}): {out['errors']}")
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()
