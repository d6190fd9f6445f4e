"""Shared plumbing for the bench scripts: a throwaway Postgres database, timing, JSON results.

Benchmarks are plain scripts, not tests: they print figures and ratios and write
``bench/results/<name>.json``; nothing asserts on speed.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from celery_outbox.db import make_engine
from orders import migrate

PG_ADMIN_URL = os.environ.get("OUTBOX_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RESULTS = Path(__file__).resolve().parent / "results"


@contextmanager
def fresh_database(prefix: str = "outbox_bench") -> Iterator[str]:
    """A database of its own (``<prefix>_<hex>``) with the library's and the Orders service's tables, dropped
    afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = make_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
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
