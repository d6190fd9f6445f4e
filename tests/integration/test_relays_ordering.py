"""Per-entity order holds when two relays publish one outbox (chaos/ordering_run.py): real ``outbox
relay`` and ``celery worker`` processes, the reference deployment's ``ordering=True`` search consumer,
several versions per order written a few commits apart so successive versions can be claimed and
published by different relays. ``bench/relays_ordering.py`` runs 1, 2 and 4 relays and records the
figures (docs/scaling.md)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path

import pytest

from celery_outbox.schema import Tables
from chaos.ordering_run import run_ordering, writer_plan
from tests.services import require_service


def test_writer_plan_interleaves_orders_and_keeps_each_orders_versions_in_order() -> None:
    # Given a plan of 30 orders x 4 versions over a window of 5 open orders
    plan = writer_plan(30, 4, window=5, seed=3)
    # Then every version of every order is written once, in version order per order
    seen: dict[str, list[int]] = defaultdict(list)
    for oid, version in plan:
        seen[oid].append(version)
    assert len(seen) == 30 and all(v == [1, 2, 3, 4] for v in seen.values())
    # And orders interleave: some order's next version comes after another order's version
    assert any(a[0] != b[0] and a[1] < 4 for a, b in itertools.pairwise(plan))


@pytest.mark.postgres
@pytest.mark.rabbitmq
@pytest.mark.workers
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_relays_keep_per_entity_order_with_real_workers(tmp_path: Path, tables: Tables) -> None:
    """Given two relays draining one outbox and two workers (4 threads each) on the ordered search
    consumer, when 80 orders x 4 versions are written interleaved, then every order's document went
    through versions 1, 2, 3, 4 in that order, each once; whatever was parked was released; nothing
    is left parked or dead-lettered."""
    require_service("PostgreSQL", "127.0.0.1", 5432)
    require_service("RabbitMQ", "127.0.0.1", 5672)
    lines: list[str] = []
    report = run_ordering(relays=2, orders=80, versions=4, workers=2, concurrency=4, rate=100.0,
                          workdir=tmp_path / "ordering", tables=tables, progress=lines.append)
    detail = "\n".join(lines[-80:])
    assert report.quiesced, detail
    assert report.violations == [], f"{report.violations}\n{detail}"
    assert report.written == report.applied == 80 * 4
    assert report.applied_out_of_order == 0, report.out_of_order_examples
    assert report.orders_incomplete == 0
    assert report.stale_skipped == 0  # each version written once: nothing can be stale
    assert report.released == report.parked and report.still_parked == 0
    assert report.dead_letters == 0
