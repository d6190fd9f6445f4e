"""One 3-node RabbitMQ cluster per test session (chaos/cluster.py), started only if a test asks for it.

Without Debian's ``rabbitmq-server`` the tests skip with the reason (they fail under CI=true, like
every missing service). Each test gets the cluster with all three nodes running: a test that stopped
a node and failed before restarting it does not leave the next one a smaller cluster.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from chaos.cluster import RabbitCluster, rabbitmq_missing
from tests.services import IN_CI


@pytest.fixture(scope="session")
def rabbit_cluster_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitCluster]:
    reason = rabbitmq_missing()
    if reason:
        if IN_CI:
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    cluster = RabbitCluster(workdir=tmp_path_factory.mktemp("rabbit-cluster"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def rabbit_cluster(rabbit_cluster_session: RabbitCluster) -> RabbitCluster:
    """The session's cluster, every node running."""
    cluster = rabbit_cluster_session
    for node in cluster.nodes:
        if not cluster.alive(node):
            cluster.start_node(node.index)
    return cluster
