"""The failure-matrix row "broker cluster node lost": orders flow through the reference deployment on
a 3-node cluster with quorum queues while node 1 is stopped and restarted, then node 2 is SIGKILLed
and restarted (chaos/cluster_run.py). 0 lost, 0 doubled, nothing pending or dead-lettered; the relay
and both workers lived through it on the failover URL. CI runs ``OUTBOX_NODE_LOSS_ORDERS`` orders
(300 by default); ``bench/cluster_node_loss.py`` runs 2,000 and records its figures.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from celery_outbox.schema import Tables
from chaos.cluster import RabbitCluster
from chaos.cluster_run import run_node_loss
from tests.services import require_service

pytestmark = [pytest.mark.cluster, pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.workers,
              pytest.mark.chaos, pytest.mark.slow]

ORDERS = int(os.environ.get("OUTBOX_NODE_LOSS_ORDERS", "300"))


@pytest.mark.timeout(900)
def test_orders_survive_losing_one_node_then_another(rabbit_cluster: RabbitCluster, tmp_path: Path,
                                                     tables: Tables) -> None:
    """Given the relay, two workers and the order writer on the cluster's failover URL with quorum
    queues, when node 1 is stopped and restarted and then node 2 is SIGKILLed and restarted while the
    orders flow, then every committed order has exactly one effect per consumer and one e-mail."""
    require_service("PostgreSQL", "127.0.0.1", 5432)
    lines: list[str] = []
    report = run_node_loss(cluster=rabbit_cluster, orders=ORDERS, workdir=tmp_path / "node-loss", tables=tables,
                           progress=lines.append)
    detail = "\n".join(lines[-80:])
    assert report.ok, f"{report.violations}\n{detail}"
    assert report.committed == ORDERS
    assert (report.lost, report.doubled) == (0, 0), detail
    assert set(report.queue_types.values()) == {"quorum"}, report.queue_types
    assert [(loss.node, loss.how) for loss in report.losses] == [(1, "stop"), (2, "kill")]
    for loss in report.losses:  # the relay published and the workers committed again while the node was down
        assert loss.relay_recovered_s is not None, detail
        assert loss.workers_recovered_s is not None, detail
