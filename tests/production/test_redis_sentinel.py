"""The failure-matrix row "Redis primary fails behind Sentinel" (chaos/failover_run.py).

The order writer, the relay and two workers are on the group's ``sentinel://`` URL with its master's
name (``OUTBOX_BROKER_SENTINEL_MASTER``). Mid-load the workers are frozen and the replica's stream
paused for a second, so what the relay publishes then reaches the primary only; the primary is
SIGKILLed and worker 2 with it; the sentinels promote the replica. Those messages are gone from Redis
while their rows are marked published; the reconciler re-sends them (on the consumers' progress or
an empty queue, relay/reconcile.py), and every order ends with exactly one effect per consumer and one
e-mail. How many it re-sent is reported, not asserted: it depends on what the relay published in that
second. ``OUTBOX_SENTINEL_FAILOVER_ORDERS`` orders (200 by default); ``bench/failover.py`` records the
figures in docs/deployment.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_outbox.schema import Tables
from chaos.failover_run import run_sentinel_failover
from chaos.sentinel import SentinelGroup
from tests.production.sentinel import started_group
from tests.services import require_service

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers, pytest.mark.chaos, pytest.mark.slow]

ORDERS = int(os.environ.get("OUTBOX_SENTINEL_FAILOVER_ORDERS", "200"))


@pytest.fixture
def sentinel_group() -> Iterator[SentinelGroup]:
    yield from started_group()


@pytest.mark.timeout(300)
def test_sentinel_failover_loses_messages_and_the_reconciler_brings_every_effect_back_once(
        sentinel_group: SentinelGroup, tmp_path: Path, tables: Tables) -> None:
    """Given every process on a sentinel:// URL and a second of publishes that never reached the replica,
    when the Redis primary and a worker are SIGKILLed and the sentinels promote the replica, then every
    order has exactly one effect per consumer and one e-mail, nothing is pending or dead-lettered, and
    the relay, the workers and the writer carried on without a restart (worker 2 was started again)."""
    require_service("PostgreSQL", "127.0.0.1", 5432)
    lines: list[str] = []
    report = run_sentinel_failover(group=sentinel_group, orders=ORDERS, workdir=tmp_path / "run", tables=tables,
                                   progress=lines.append)
    detail = "\n".join(lines[-80:])
    assert report.ok, f"{report.violations} {report.unexpected_exits}\n{detail}"
    assert report.published_in_window >= 1, "nothing was published while replication was paused: not provoked"
    assert report.present == ORDERS
    assert (report.lost, report.doubled, report.lost_commits) == (0, 0, 0), detail
    rec = report.recovery
    assert None not in (rec.relay_s, rec.workers_s), rec
