"""A dead letter's whole story on one page of a real Flower, read in a real headless Chromium.

A real ``celery -A relay.app worker`` and ``celery -A relay.app flower`` on real Postgres and Redis. The
shipping consumer fails (a trigger refuses its shipment: the carrier is "down") until it is dead-lettered;
the trigger is dropped (the fix) and the dead letter is replayed with the CLI an operator runs
(``outbox dead-letters replay``). Flower's page for the task the message was first delivered as must
then tell it all, as docs/operations.md ("Flower") describes: SUCCESS with the result ``processed``, the
dead-lettering reason naming the dead letter (``consumer:<id>``) and its group, the failed and succeeded
times. The effect happened once. A screenshot of the page is saved under ``var/flower/`` (not committed).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_outbox import Tables
from celery_outbox.db import make_engine
from celery_outbox.messages import celery_task_messages
from celeryconfig import Settings
from consumers.models import Shipment
from consumers.testing import order_placed_envelope
from tests.integration.test_admin_browser import ARGS, CHROMIUM, require_chromium
from tests.integration.test_consumer_worker import CELERY, ROOT, cleanup, declare
from tests.ops.test_flower import Stack, free_port, publish_messages, start

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers, pytest.mark.browser, pytest.mark.slow]

OUTBOX = str(Path(sys.executable).with_name("outbox"))
SCREENSHOTS = ROOT / "var" / "flower"


@pytest.fixture
def redis_stack(pg_url: str, redis_url: str, namespace: str, tmp_path: Path) -> Iterator[Stack]:
    """A worker running the shipping consumer (3 deliveries, 1-2 s apart) and a Flower, on Redis."""
    require_chromium()
    home = tmp_path / "home"
    home.mkdir()
    settings = Settings(home=home, database_url=pg_url, broker_url=redis_url, namespace=namespace,
                        consumer_max_deliveries=3, consumer_retry_backoff_s=1, consumer_retry_backoff_max_s=2)
    declare(settings, redis_url)
    env = {**os.environ, "OUTBOX_DATABASE_URL": pg_url, "OUTBOX_BROKER_URL": redis_url, "OUTBOX_NAMESPACE": namespace,
           "OUTBOX_HOME": str(home), "OUTBOX_CONSUMER_MAX_DELIVERIES": "3", "OUTBOX_CONSUMER_RETRY_BACKOFF_S": "1",
           "OUTBOX_CONSUMER_RETRY_BACKOFF_MAX_S": "2"}
    env.pop("OUTBOX_CRASH_POINTS", None)
    worker = start([CELERY, "-A", "relay.app", "worker", "-Q", settings.queue_name("shipping"), "-P", "prefork",
                    "-c", "1", "--without-gossip", "--without-mingle", "-l", "INFO",
                    "-n", f"replay-{namespace}@%h"], env, tmp_path / "worker.log")
    port = free_port()
    flower = start([CELERY, "-A", "relay.app", "flower", f"--port={port}", "--address=127.0.0.1"],
                   {**env, "FLOWER_UNAUTHENTICATED_API": "true"}, tmp_path / "flower.log")
    s = Stack(settings=settings, broker_url=redis_url, node=f"replay-{namespace}@{socket.gethostname()}",
              worker=worker, flower=flower, base=f"http://127.0.0.1:{port}")
    try:
        yield s
    finally:
        flower.stop()
        worker.stop()
        cleanup(settings, redis_url)


def carrier_down(url: str, order_id: str, name: str) -> Callable[[], None]:
    """A trigger that refuses ``order_id``'s shipment (the consumer fails every delivery); returns the fix."""
    engine = make_engine(url)
    with engine.begin() as c:
        c.exec_driver_sql(
            f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"IF NEW.order_id = '{order_id}' THEN RAISE EXCEPTION USING MESSAGE = 'carrier down for ' || NEW.order_id; "
            f"END IF; "
            f"RETURN NEW; END $$")
        c.exec_driver_sql(f"CREATE TRIGGER {name} BEFORE INSERT ON shipments FOR EACH ROW EXECUTE FUNCTION {name}()")

    def fix() -> None:
        with engine.begin() as c:
            c.exec_driver_sql(f"DROP TRIGGER IF EXISTS {name} ON shipments")
            c.exec_driver_sql(f"DROP FUNCTION IF EXISTS {name}()")
        engine.dispose()

    return fix


def test_a_replayed_dead_letter_turns_its_flower_task_from_failure_to_success(
        redis_stack: Stack, pg_url: str, tables: Tables, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    stack, settings = redis_stack, redis_stack.settings
    stack.wait("Flower to see the worker", lambda: (bool(stack.worker_counters()), stack.get("/workers?json=1")))
    stack.wait_task_events_on()  # no -E, none in the configuration: Flower turns them on (docs/operations.md)
    order_id = f"o-replay-{uuid.uuid4().hex[:8]}"
    fix = carrier_down(pg_url, order_id, f"carrier_down_{settings.namespace}")
    try:
        # Given an order published to shipping while the carrier refuses it
        order = order_placed_envelope(order_id)
        [msg] = celery_task_messages(order, targets=[("shipping", settings.queue_name("shipping"))])
        tid = msg.headers["id"]
        publish_messages(settings, stack.broker_url, [msg])

        def state(want: str) -> Callable[[], tuple[bool, object]]:
            return lambda: ((t := stack.tasks().get(tid, {})).get("state") == want, t)

        # When its deliveries are used up: Flower shows the task as FAILURE, naming its dead letter and group
        stack.wait("the delivery to be dead-lettered", state("FAILURE"))
        engine = make_engine(pg_url)
        with engine.connect() as c:
            dl_id, group, kept_tid = c.execute(sa.select(tables.dead_letters.id, tables.dead_letters.fingerprint,
                                                         tables.dead_letters.task_id)).one()
        assert kept_tid == tid
        failed = stack.tasks()[tid]
        assert f"as consumer:{dl_id} (group {group})" in failed["exception"], failed
        assert "carrier down for " + order_id in failed["exception"], failed
    finally:
        fix()  # And the carrier is back
    # When the operator replays the dead letter
    env = {**os.environ, "OUTBOX_DATABASE_URL": pg_url, "OUTBOX_BROKER_URL": stack.broker_url,
           "OUTBOX_NAMESPACE": settings.namespace, "OUTBOX_HOME": str(settings.home)}
    replay = subprocess.run([OUTBOX, "-A", "relay.app", "dead-letters", "replay", f"consumer:{dl_id}"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert f"as task {tid}" in replay.stdout, replay.stdout
    # Then the same task turns SUCCESS in Flower, and the shipment exists once
    stack.wait("the replay to succeed under the task's own id", state("SUCCESS"))
    with engine.connect() as c:
        assert c.execute(sa.select(sa.func.count()).select_from(Shipment)
                         .where(Shipment.order_id == order_id)).scalar_one() == 1
    engine.dispose()

    # And the task's page, in a browser, tells the whole story
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / "replayed-task.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            resp = page.goto(f"{stack.base}/task/{tid}")
            assert resp is not None and resp.status == 200
            rows = detail_rows(page)
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert rows["UUID"].split()[0] == tid
    assert rows["Status"] == "SUCCESS", rows
    assert rows["Result"] == "'processed'", rows
    assert rows["Exception"].startswith(
        f"DeadLettered(dead-lettered for shipping after 3 deliveries as consumer:{dl_id} (group {group}): "), rows
    # the dead-lettering first, the replay's success after it (Flower prints both as UTC date-times)
    assert rows["Failed"] < rows["Succeeded"], rows
    assert rows["Worker"] == stack.node, rows
    assert shot.stat().st_size > 0


def detail_rows(page: Any) -> dict[str, str]:
    """Flower's task page as ``{label: text}`` (its ``<dl class="detail-list">`` rows)."""
    found: dict[str, str] = {}
    for row in page.locator("dl.detail-list > div.detail-row").all():
        label = row.locator("dt").inner_text().strip()
        found[label] = row.locator("dd").inner_text().strip()
    return found
