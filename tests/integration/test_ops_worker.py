"""With a real ``celery worker`` on Redis: a CLI replay is processed once (twice -> still one effect),
``celery_outbox.prune`` runs in the worker, and the worker serves ``/metrics`` with the right values."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from kombu import Connection, Exchange, Queue
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables, counters
from celery_outbox.celery.sender import replay_sender
from celery_outbox.cli import cli
from celeryconfig import Settings
from consumers.models import Shipment
from devtools.processes import Child, settings_env, wait_until, worker
from relay.embedded import free_port
from relay.factory import create_outbox
from tests.ops_seed import consumer_dead_letter, envelope, outbox_row

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]


@pytest.fixture
def wsettings(settings: Settings, redis_url: str) -> Settings:
    return settings.replace(broker_url=redis_url, metrics_port=free_port())


def _queues(settings: Settings) -> list[Queue]:
    ex = Exchange(settings.exchange_name, type="direct", durable=True)
    relay = Queue(f"{settings.namespace}.relay", Exchange(f"{settings.namespace}.relay"),
                  routing_key=f"{settings.namespace}.relay", durable=True)
    return [Queue(settings.queue_name("shipping"), ex, routing_key=settings.queue_name("shipping"), durable=True),
            relay]


@pytest.fixture
def shipping_worker(wsettings: Settings, tmp_path: Path) -> Iterator[Child]:
    with Connection(wsettings.broker_url) as conn:
        for q in _queues(wsettings):
            q(conn.channel()).declare()
    child = worker(wsettings, broker_url=wsettings.broker_url, log_dir=tmp_path, pool="solo", concurrency=1,
                   queues=[wsettings.queue_name("shipping"), f"{wsettings.namespace}.relay"], name="ops-worker",
                   extra_env={"OUTBOX_METRICS_PORT": str(wsettings.metrics_port)}).start()
    try:
        yield child
    finally:
        child.stop()
        with Connection(wsettings.broker_url) as conn:
            for q in _queues(wsettings):
                q(conn.channel()).delete()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def shipments(sessions: sessionmaker[Session]) -> int:
    with sessions() as s:
        return int(s.scalar(sa.select(sa.func.count()).select_from(Shipment)) or 0)


def duplicates(sessions: sessionmaker[Session], tables: Tables) -> int:
    with sessions() as s:
        return counters.value(s, "shipping", "duplicates", tables=tables)


def run_cli(env: dict[str, str], *args: str) -> Result:
    sys.modules.pop("relay.app", None)  # the CLI's Outbox (-A relay.app) is built from this env, as in a new process
    return CliRunner().invoke(cli, list(args), env=env)


def test_replay_through_a_real_worker(wsettings: Settings, shipping_worker: Child,
                                      sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a shipping dead letter whose cause has been fixed, and an old published outbox row
    env = envelope("o-replay")
    with sqlite_sessions() as s:
        cid = consumer_dead_letter(s, tables=tables, consumer="shipping", env=env)
        outbox_row(s, tables=tables, created_at_ms=0, published_at_ms=1)
    cli_env = {k: v for k, v in settings_env(wsettings, broker_url=wsettings.broker_url).items()
               if k.startswith("OUTBOX_")}
    # When it is replayed from the CLI
    r = run_cli(cli_env, "dead-letters", "replay", f"consumer:{cid}")
    assert r.exit_code == 0, r.output
    # Then the worker makes exactly one shipment
    assert wait_until(lambda: shipments(sqlite_sessions) == 1, timeout_s=60), shipping_worker.log_tail()
    # When it is replayed again (skipped) and the same envelope is forced through once more
    r = run_cli(cli_env, "dead-letters", "replay", f"consumer:{cid}", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)[0]["replayed"] is False
    box = create_outbox(wsettings, broker_url=wsettings.broker_url, session_factory=sqlite_sessions)
    replay_sender(box.app, box)("shipping", env)
    # Then the inbox absorbs it: a duplicate counted, still one shipment
    assert wait_until(lambda: duplicates(sqlite_sessions, tables) == 1, timeout_s=60), shipping_worker.log_tail()
    assert shipments(sqlite_sessions) == 1

    # The worker serves /metrics from the database
    def metrics_ok() -> bool:
        got = scrape(wsettings.metrics_port)
        return got is not None and got.get(("outbox_inbox_entries", (("consumer", "shipping"),))) == 1 \
            and got.get(("outbox_duplicates_absorbed_total", (("consumer", "shipping"),))) == 1
    assert wait_until(metrics_ok, timeout_s=30), (scrape(wsettings.metrics_port), shipping_worker.log_tail())
    got = scrape(wsettings.metrics_port)
    assert got is not None and got[("outbox_published_retained_messages", ())] == 1
    assert ("outbox_dead_letters", (("consumer", "shipping"), ("source", "consumer"))) not in got

    # celery_outbox.prune is registered in the worker and prunes the published row
    box.app.send_task("celery_outbox.prune", kwargs={"published_older_than_ms": 1000},
                      queue=f"{wsettings.namespace}.relay")

    def pruned() -> bool:
        with sqlite_sessions() as s:
            return s.scalar(sa.select(sa.func.count()).select_from(tables.outbox)) == 0
    assert wait_until(pruned, timeout_s=60), shipping_worker.log_tail()
