"""The node-loss run: orders through the reference deployment on a 3-node RabbitMQ cluster with quorum
queues, while one node is stopped and restarted, then another is SIGKILLed and restarted.

Real processes, as in a chaos run (chaos/environment.py): the order writer (``chaos.load``), one
``outbox relay`` and two ``celery worker`` processes, every one given the cluster's failover URL
(``amqp://..n1;amqp://..n2;amqp://..n3``; the second worker's list starts at node 2, so the two
workers sit on different nodes). ``OUTBOX_BROKER_QUEUE_TYPE=quorum``: every consumer, task and relay
queue is a quorum queue replicated on the three nodes. Node 1 is stopped gracefully (``rabbitmqctl
stop``) at a quarter of the orders and restarted; node 2 is SIGKILLed at 60% and restarted. Then the
run waits for quiescence and checks chaos/invariants.py: 0 lost (every committed order has its
effect in every consumer and its e-mail), 0 doubled (exactly one effect each), nothing pending,
nothing dead-lettered. Used by tests/cluster/test_node_loss.py (a few hundred orders) and
bench/cluster_node_loss.py (2,000, figures in docs/scaling.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from celery_outbox.schema import Tables
from chaos import invariants
from chaos.cluster import QUORUM_ENV, ClusterBroker, RabbitCluster
from chaos.environment import ChaosEnvironment
from chaos.load import make_plan
from consumers.models import Shipment
from orders.models import Order

Progress = Callable[[str], None]


@dataclass(kw_only=True)
class NodeLoss:
    """One provocation: which node, how, when (in committed orders) and how long until things moved again."""

    node: int
    how: str  # "stop" (rabbitmqctl stop) or "kill" (SIGKILL of the VM)
    at_orders: int
    down_s: float = 0.0  # from the stop to the node back in the cluster
    relay_recovered_s: float | None = None  # from the stop to the first row published after it
    workers_recovered_s: float | None = None  # from the stop to the first shipment committed after it


@dataclass(kw_only=True)
class NodeLossReport:
    orders: int
    committed: int = 0
    losses: list[NodeLoss] = field(default_factory=list)
    lost: int = 0  # committed orders missing an effect or an e-mail
    doubled: int = 0  # effects done more than once
    duplicates_absorbed: int = 0
    violations: list[str] = field(default_factory=list)
    quiesced: bool = False
    duration_s: float = 0.0
    drain_s: float = 0.0  # from the last order committed to quiescence
    queue_types: dict[str, str] = field(default_factory=dict)
    broker_url_form: str = ""
    cluster_startup_s: float = 0.0
    interval_ms: int = 0  # the order writer's pause between orders

    @property
    def ok(self) -> bool:
        return self.quiesced and not self.violations

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _first_after(env: ChaosEnvironment, stmt_of: Callable[[int], Any], *, since_ms: int, timeout_s: float) -> float | None:
    """Seconds from ``since_ms`` to the first row ``stmt_of(since_ms)`` finds, polled; None on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        first = env.scalar(stmt_of(since_ms))
        if first is not None:
            return max(0.0, (int(first) - since_ms) / 1000)
        time.sleep(0.2)
    return None


def run_node_loss(*, cluster: RabbitCluster, orders: int, workdir: Path, tables: Tables | None = None,
                  writer_s: float = 60.0, timeout_s: float = 600.0, progress: Progress | None = None) -> NodeLossReport:
    """See the module docstring. The orders are spread over about ``writer_s`` seconds, so they still flow
    when the second node goes (a node's stop and restart take 10-20 s here)."""
    interval_ms = max(1, int(writer_s * 1000 / max(orders, 1)))
    say = progress or (lambda _m: None)
    report = NodeLossReport(orders=orders, cluster_startup_s=cluster.startup_s,
                            broker_url_form="amqp://user:pass@host1:5672//;amqp://user:pass@host2:5672//;"
                                            "amqp://user:pass@host3:5672//")
    report.interval_ms = interval_ms
    plan = make_plan(orders, prefix="nl")
    started = time.monotonic()
    env = ChaosEnvironment(broker="rabbitmq", workdir=workdir, extra_env=QUORUM_ENV, tables=tables,
                           broker_impl=ClusterBroker(cluster))
    with env:
        outbox = env.tables.outbox
        relay = env.relay("relay")
        w1, w2 = env.worker("worker-1"), env.worker("worker-2")
        writer = env.orders(plan, interval_ms=interval_ms)
        relay.start()
        w1.start()
        w2.start(extra_env={"OUTBOX_BROKER_URL": cluster.url_from(2)})
        say(f"database {env.db_name}, namespace {env.namespace}, logs {workdir / 'logs'}")
        consumed = [q for q in env.settings.worker_queues if q != f"{env.namespace}.relay"]  # the relay is its own process
        env.wait(lambda: len(cluster.queue_info(consumed)) == len(consumed), timeout_s=120,
                 what="the workers' queues declared")
        report.queue_types = {q: row.split("\t")[0] for q, row in cluster.queue_info(consumed, ("name", "type")).items()}
        writer.start()
        plan_steps = [NodeLoss(node=1, how="stop", at_orders=orders // 4),
                      NodeLoss(node=2, how="kill", at_orders=(orders * 3) // 5)]
        for loss in plan_steps:
            env.wait(lambda n=loss.at_orders: env.count(Order) >= n or not writer.alive(),  # type: ignore[misc]
                     timeout_s=timeout_s, what=f"{loss.at_orders} orders committed")
            loss.at_orders = env.count(Order)
            since_ms = int(time.time() * 1000)
            t0 = time.monotonic()
            say(f"{loss.how} node {loss.node} at {loss.at_orders} committed orders")
            if loss.how == "stop":
                cluster.stop_node(loss.node)
            else:
                cluster.kill_node(loss.node)
            loss.relay_recovered_s = _first_after(
                env, lambda t: sa.select(sa.func.min(outbox.published_at_ms)).where(outbox.published_at_ms > t),
                since_ms=since_ms, timeout_s=30)
            loss.workers_recovered_s = _first_after(
                env, lambda t: sa.select(sa.func.min(Shipment.created_at_ms)).where(Shipment.created_at_ms > t),
                since_ms=since_ms, timeout_s=30)
            cluster.start_node(loss.node)
            loss.down_s = time.monotonic() - t0
            say(f"node {loss.node} back after {loss.down_s:.1f}s (relay published again after "
                f"{loss.relay_recovered_s}s, workers committed again after {loss.workers_recovered_s}s)")
            report.losses.append(loss)
        code = writer.wait_exit(timeout_s=timeout_s)
        if code != 0:
            report.violations.append(f"order writer exited {code}")
        last_order = time.monotonic()
        for proc in (relay, w1, w2):
            if not proc.alive():
                report.violations.append(f"{proc.name} exited {proc.returncode()} during the run")

        def done() -> bool:
            with env.sessions() as s:
                return invariants.quiescent(s, tables=env.tables, consumers=env.consumers, expected_dead_letters=0)

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not done():
            time.sleep(0.5)
        report.quiesced = done()
        report.drain_s = time.monotonic() - last_order
        time.sleep(1.0)  # a late duplicate lands before the final read
        with env.sessions() as s:
            check = invariants.check(s, tables=env.tables, consumers=env.consumers, rolled_back=[], poison=[],
                                     now_ms=int(time.time() * 1000))
            by_order = invariants.effect_counts_by_order(s, tables=env.tables)
        report.committed = check.snapshot.committed_orders
        report.duplicates_absorbed = check.snapshot.duplicates_absorbed
        report.violations += [f"{v.invariant}: {v.detail}" for v in check.violations]
        order_ids = {str(p["order_id"]) for p in plan}
        report.lost = sum(1 for counts in by_order.values() for oid in order_ids if counts.get(oid, 0) == 0)
        report.doubled = sum(1 for counts in by_order.values() for n in counts.values() if n > 1)
        if not report.ok:
            say(env.logs())
    report.duration_s = time.monotonic() - started
    return report
