"""The scripted incident drill of docs/incident-drill.md: dead letters in two groups, a stopped relay, one order
traced. The commands are read from the page itself (its bash block), so the commands the docs show are the ones
that run here, as real ``outbox`` processes against real Postgres and Redis and a real ``outbox relay``.

Only the page's placeholders are filled in: ``GROUP_ID`` with the shipping group (the cause is fixed: replay
it) and ``OTHER_GROUP_ID`` with the billing group (archive and purge it), both read from the listing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.clock import SystemClock
from tests.ops_seed import consumer_dead_letter, envelope, order_payload

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "incident-drill.md"
OUTBOX = str(Path(sys.executable).parent / "outbox")
STEPS = [["stats"], ["trace"], ["dead-letters", "groups"], ["dead-letters", "replay"], ["dead-letters", "replay"],
         ["dead-letters", "purge"], ["stats"]]  # what the page's block runs, in order


def drill_commands(page: Path = PAGE) -> list[list[str]]:
    """Every command of the page's first bash block, split as a shell would."""
    text = page.read_text()
    body = text[text.index("```bash\n") + len("```bash\n"):]
    body = body[:body.index("```")]
    return [words for line in body.splitlines() if (words := shlex.split(line, comments=True))]


def test_the_page_shows_the_drill_commands_in_order() -> None:
    commands = drill_commands()
    assert all(c[0] == "outbox" for c in commands), commands
    assert [[w for w in c[1:] if not w.startswith("-") and w in {"stats", "trace", "dead-letters", "groups",
                                                                          "replay", "purge"}] for c in commands] == STEPS


@pytest.fixture
def env(pg_url: str, redis_url: str, namespace: str, tmp_home: Path) -> Iterator[dict[str, str]]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    e.update(OUTBOX_DATABASE_URL=pg_url, OUTBOX_BROKER_URL=redis_url, OUTBOX_NAMESPACE=namespace,
             OUTBOX_HOME=str(tmp_home), OUTBOX_RELAY_POLL_INTERVAL_S="0.5", PYTHONPATH=str(REPO),
             OUTBOX_APP="relay.app",  # the reference deployment names its Outbox, as the page tells a user to
             COLUMNS="200")  # rich tables print whole lines when not on a terminal
    yield e
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(f"{namespace}*")) + list(client.scan_iter(f"_kombu.binding.{namespace}*"))
    if keys:
        client.delete(*keys)
    client.close()


class Relay:
    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> subprocess.Popen[bytes]:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([OUTBOX, "relay"], cwd=REPO, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self.proc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture
def relay(env: dict[str, str], tmp_path: Path) -> Iterator[Relay]:
    r = Relay(env, tmp_path / "relay.log")
    try:
        yield r
    finally:
        r.kill()


def wait_for(cond: Callable[[], bool], what: str, log: Path, deadline_s: float = 90.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)


def unpublished(sessions: sessionmaker[Session], tables: Tables) -> int:
    with sessions() as s:
        return int(s.scalar(sa.select(sa.func.count()).where(tables.outbox.published_at_ms.is_(None))) or 0)


def build_incident(sessions: sessionmaker[Session], tables: Tables, relay: Relay) -> uuid.UUID:
    """The page's incident; returns order 42's message id."""
    now = SystemClock().now_ms()
    order_42 = uuid.uuid4()
    # Order 42's event, published by the real relay
    proc = relay.start()
    with sessions() as s:
        s.add(tables.outbox(message_id=order_42, type="OrderPlaced", payload=order_payload("42"),
                            headers={"correlation_id": "req-42", "entity_key": "order:42", "entity_version": 1},
                            created_at_ms=now, next_attempt_at_ms=now, attempts=0))
        s.commit()
    wait_for(lambda: unpublished(sessions, tables) == 0, "the relay to publish order 42", relay.log)
    # ... which shipping processed and billing dead-lettered, with two other orders it could not find
    with sessions() as s:
        s.add(tables.inbox(message_id=order_42, consumer="shipping", type="OrderPlaced", processed_at_ms=now + 80))
        s.commit()
        for order, mid in (("42", order_42), ("7", None), ("9", None)):
            consumer_dead_letter(s, tables=tables, consumer="billing", env=envelope(order, message_id=mid),
                                 failed_at_ms=now + 2000, error=f"LookupError: order {order} not found")
        # Shipping dead-lettered two while its carrier was down
        for order in ("11", "12"):
            consumer_dead_letter(s, tables=tables, consumer="shipping", env=envelope(order), failed_at_ms=now + 3000,
                                 error="RuntimeError: carrier down (HTTP 503)")
    # The relay stops silently; order 43's event has waited for it for five minutes
    os.killpg(proc.pid, signal.SIGSTOP)
    with sessions() as s:
        s.add(tables.outbox(message_id=uuid.uuid4(), type="OrderPlaced", payload=order_payload("43"),
                            headers={"correlation_id": "req-43", "entity_key": "order:43", "entity_version": 1},
                            created_at_ms=now - 300_000, next_attempt_at_ms=now - 300_000, attempts=0))
        s.commit()
    return order_42


def run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([OUTBOX, *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_incident_drill_runs_as_the_docs_show(env: dict[str, str], pg_sessions: sessionmaker[Session],
                                                 tables: Tables, relay: Relay, tmp_path: Path) -> None:
    order_42 = build_incident(pg_sessions, tables, relay)
    stats1, trace, groups, dry_run, replay, purge, stats2 = drill_commands()
    work = tmp_path / "oncall"
    work.mkdir()

    # 1. Is anything stuck? exit 3: a due row no relay publishes, and the dead letters
    r = run(stats1, env, work)
    assert r.returncode == 3, r.stdout + r.stderr
    assert re.search(r"has been due for 5m \d+s and no relay has published it", r.stderr), r.stderr
    assert "5 unreplayed dead letter(s)" in r.stderr
    # The operator restarts the relay (the stopped process is killed, a new one started); its backlog drains
    relay.kill()
    relay.start()
    wait_for(lambda: unpublished(pg_sessions, tables) == 0, "the restarted relay to drain", relay.log)

    # 2. Where is order 42's message? published, processed by shipping, dead-lettered by billing
    r = run(trace, env, work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert str(order_42) in r.stdout and "published" in r.stdout
    assert "shipping" in r.stdout and "billing" in r.stdout and "order 42 not found" in r.stdout

    # 3. What is failing and how much? two groups, 3 and 2
    r = run(groups, env, work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 group(s), 5 dead letter(s)" in r.stdout
    listed = json.loads(run([*groups, "--json"], env, work).stdout)
    by_consumer = {g["consumer"]: g for g in listed}
    assert {c: g["count"] for c, g in by_consumer.items()} == {"billing": 3, "shipping": 2}
    for g in listed:
        assert g["id"] in r.stdout
    fill = {"GROUP_ID": by_consumer["shipping"]["id"], "OTHER_GROUP_ID": by_consumer["billing"]["id"]}

    def filled(argv: list[str]) -> list[str]:
        return [fill.get(w, w) for w in argv]

    # 4. What would a replay send? two messages to shipping's queue; nothing changes
    r = run(filled(dry_run), env, work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "would send 2 to" in r.stdout and "shipping" in r.stdout and "nothing was changed" in r.stdout
    # 5. Replay it: both sent, a summary line
    r = run(filled(replay), env, work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"summary: group {fill['GROUP_ID']}: 2 replayed; 2 of 2" in r.stdout
    # 6. Archive and purge billing's group: three dead letters in the archive, none left
    r = run(filled(purge), env, work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"summary: group {fill['OTHER_GROUP_ID']}: 3 purged; 3 of 3" in r.stdout
    archived = [json.loads(line) for line in (work / "dead-letters.jsonl").read_text().splitlines()]
    assert len(archived) == 3 and str(order_42) in json.dumps(archived)

    # 7. All clear: the same check exits 0
    r = run(stats2, env, work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == ""
