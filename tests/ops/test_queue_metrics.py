"""A consumer queue with messages and no worker is visible: a real worker serving ``/metrics`` reports each
consumer queue's depth from the broker, and on RabbitMQ its consumer count (alert ``OutboxQueueWithoutConsumer``;
``OutboxConsumerQueueStuck`` on both brokers, from the depth and the processed counter: promtool tests in
ops/prometheus/outbox-alerts.test.yml)."""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from kombu import Connection, Exchange, Queue
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.celery.queue_depth import queue_depths
from celery_outbox.cli import cli
from celery_outbox.ops.metrics import QueueDepth, make_registry, render
from celeryconfig import Settings
from devtools.processes import Child, settings_env, wait_until, worker
from relay.embedded import free_port
from tests.ops_seed import outbox_row

pytestmark = [pytest.mark.workers, pytest.mark.slow]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(params=["redis", "rabbitmq"])
def wsettings(request: pytest.FixtureRequest, settings: Settings) -> Iterator[Settings]:
    url: str = request.getfixturevalue(f"{request.param}_url")
    s = settings.replace(broker_url=url, metrics_port=free_port())
    yield s
    with Connection(url) as conn:  # this run's queues and exchanges, whatever the test left
        channel = conn.channel()
        for consumer in ("shipping", "billing", "search", "email", "relay"):
            Queue(s.queue_name(consumer), no_declare=True)(channel).delete()
        for name in (s.exchange_name, f"{s.namespace}.relay"):
            Exchange(name)(channel).delete()


def scrape(port: int) -> Samples | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def depth(got: Samples, settings: Settings, consumer: str, metric: str = "outbox_queue_messages") -> float | None:
    return got.get((metric, (("consumer", consumer), ("queue", settings.queue_name(consumer)))))


def test_a_queue_no_worker_takes_from_is_visible(wsettings: Settings, sqlite_sessions: sessionmaker[Session],
                                                 tables: Tables, tmp_path: Path) -> None:
    # Given two orders relayed to every consumer's queue (shipping, billing, search)
    with sqlite_sessions() as s:
        for _ in range(2):
            outbox_row(s, tables=tables, created_at_ms=1)
    env = {k: v for k, v in settings_env(wsettings, broker_url=wsettings.broker_url).items() if k.startswith("OUTBOX_")}
    sys.modules.pop("relay.app", None)  # the CLI's Outbox is built from this env, as in a new process
    r = CliRunner().invoke(cli, ["relay", "--once"], env=env)
    assert r.exit_code == 0 and "published 2" in r.output, r.output
    assert [d.messages for d in queue_depths(wsettings.broker_url, [(wsettings.queue_name("billing"), "billing")])] == [2]
    # When a worker serving /metrics takes from the shipping queue only
    child: Child = worker(wsettings, broker_url=wsettings.broker_url, log_dir=tmp_path, pool="solo", concurrency=1,
                          queues=[wsettings.queue_name("shipping")], name="shipping-only",
                          extra_env={"OUTBOX_METRICS_PORT": str(wsettings.metrics_port)}).start()
    try:
        def settled() -> bool:
            got = scrape(wsettings.metrics_port)
            return got is not None and depth(got, wsettings, "shipping") == 0 and depth(got, wsettings, "billing") == 2
        assert wait_until(settled, timeout_s=90), (scrape(wsettings.metrics_port), child.log_tail())
        got = scrape(wsettings.metrics_port)
    finally:
        child.stop()
    assert got is not None
    # Then shipping's queue is empty, billing's and search's hold both messages: nobody takes from them
    assert got[("outbox_queue_probe_up", ())] == 1
    assert depth(got, wsettings, "search") == 2
    if wsettings.broker_url.startswith("amqp"):
        # And RabbitMQ says who listens: one consumer on shipping, none on billing
        assert depth(got, wsettings, "shipping", "outbox_queue_consumers") == 1
        assert depth(got, wsettings, "billing", "outbox_queue_consumers") == 0
    else:
        # Redis cannot tell: no consumer count is made up
        assert not [k for k in got if k[0] == "outbox_queue_consumers"]


def test_an_unreachable_broker_reports_probe_down_and_keeps_the_database_figures(
        sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a queue probe aimed at a broker address nothing listens on
    url = f"redis://127.0.0.1:{free_port()}/0"

    def probe() -> list[QueueDepth]:
        return queue_depths(url, [("x.shipping", "shipping")], timeout_s=0.5)
    # When /metrics is rendered
    text = render(make_registry(tables=tables, session_factory=sqlite_sessions, queue_probe=probe)).decode()
    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    # Then the probe says it is down, invents no depth, and the database's figures are still there
    assert got["outbox_queue_probe_up"] == 0 and got["outbox_stats_up"] == 1
    assert "outbox_queue_messages" not in got and "outbox_queue_consumers" not in got
