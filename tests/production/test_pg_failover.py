"""The failure-matrix row "Postgres primary fails, standby promoted" (chaos/failover_run.py).

The order writer, the relay and two workers share one multi-host URL and are never restarted; mid-load
the standby's WAL stream is paused, the primary SIGKILLed about a second later and the standby
promoted. With asynchronous replication the commits of that second are lost, each order with its
outbox rows; with a synchronous standby nothing the writer saw committed is lost. Either way every
order present afterwards has exactly one effect per consumer and one e-mail, and every process
carried on against the new primary. ``OUTBOX_PG_FAILOVER_ORDERS`` orders per run (200 by default);
``bench/failover.py`` records the figures in docs/deployment.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_outbox.schema import Tables
from chaos.failover_run import run_pg_failover
from chaos.pg_pair import PgPair
from tests.production.pg_failover import started_pair

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers, pytest.mark.chaos, pytest.mark.slow]

ORDERS = int(os.environ.get("OUTBOX_PG_FAILOVER_ORDERS", "200"))


@pytest.fixture
def pg_pair() -> Iterator[PgPair]:
    yield from started_pair()


@pytest.mark.timeout(300)
def test_async_failover_loses_the_unreplicated_orders_whole_and_nothing_else(pg_pair: PgPair, tmp_path: Path,
                                                                             tables: Tables) -> None:
    """Given an asynchronous standby whose WAL stream is paused for a second while orders commit on the
    primary, when the primary is SIGKILLed and the standby promoted, then the orders of that second are
    gone, each with its outbox rows (none without the other), every order still present has exactly one
    effect per consumer and one e-mail, and the relay, the workers and the writer recovered on their own."""
    lines: list[str] = []
    report = run_pg_failover(pair=pg_pair, orders=ORDERS, workdir=tmp_path / "run", tables=tables,
                             replication="async", progress=lines.append)
    detail = "\n".join(lines[-80:])
    assert report.ok, f"{report.violations} {report.unexpected_exits}\n{detail}"
    assert report.present + report.lost_commits >= report.committed_seen
    assert report.lost_commits >= 1, "nothing was lost: the pause did not hold back any commit"
    assert report.lost_in_window == report.lost_commits, "an order committed before the pause was lost"
    assert (report.orphans, report.lost, report.doubled) == (0, 0, 0), detail
    # Messages published from the lost commits are still delivered: at most once each, never doubled.
    assert report.ghost_effects + report.ghost_dead_letters <= 4 * report.lost_commits
    rec = report.recovery
    assert None not in (rec.writer_s, rec.relay_s, rec.workers_s), rec


@pytest.mark.timeout(300)
def test_sync_failover_loses_nothing_the_writer_saw_committed(pg_pair: PgPair, tmp_path: Path,
                                                              tables: Tables) -> None:
    """Given a synchronous standby whose WAL stream is paused for a second, when the primary is SIGKILLed
    and the standby promoted, then every order the writer saw committed is there with exactly one effect
    per consumer and one e-mail, and no effect exists for an order that is not."""
    lines: list[str] = []
    report = run_pg_failover(pair=pg_pair, orders=ORDERS, workdir=tmp_path / "run", tables=tables,
                             replication="sync", progress=lines.append)
    detail = "\n".join(lines[-80:])
    assert report.ok, f"{report.violations} {report.unexpected_exits}\n{detail}"
    assert report.committed_seen >= ORDERS - 1  # an order whose commit outcome the kill hid may go unseen
    assert report.present == ORDERS
    assert (report.lost_commits, report.orphans, report.lost, report.doubled) == (0, 0, 0, 0), detail
    assert (report.ghost_effects, report.ghost_dead_letters) == (0, 0), detail
    rec = report.recovery
    assert None not in (rec.writer_s, rec.relay_s, rec.workers_s), rec
