"""A backlog that cannot hide, with real ``outbox relay`` processes stopped silently (SIGSTOP: no crash, no
closed connection, nothing in any log).

- Every relay stopped: due rows wait, ``outbox stats --max-overdue`` exits 3 once they have waited longer than
  its limit, and the metric ``outbox_oldest_overdue_seconds`` (alert ``OutboxOverdue``) reports the same wait.
  A row backing off after failed publishes is old the whole time and never trips it.
- One relay stopped mid-batch, holding its claim while another relay runs: the other relay publishes
  everything else, ``outbox stats --max-claim-held`` and ``outbox_relay_claim_held_seconds`` (alert
  ``OutboxRelayClaimStuck``) name the stuck claim, and once Postgres ends the silent transaction the rows are
  published and every figure is quiet again.

The alerts' own thresholds on these metrics are checked by promtool (tests/ops/test_dashboards.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.clock import SystemClock
from celery_outbox.ops import stats as ops_stats
from celery_outbox.ops.metrics import make_registry, render

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
OUTBOX = str(Path(sys.executable).parent / "outbox")
LIMIT_S = 15  # the --max-overdue / --max-claim-held limit these tests use
IDLE_TIMEOUT_S = 90  # Postgres ends the stuck relay's silent transaction after this long


class Relays:
    """Real ``outbox relay`` processes, each in its own session; all killed for sure at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def start(self, name: str, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([OUTBOX, "relay", *args], cwd=REPO, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, proc, log))
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {n} ---\n{log.read_text(errors='replace')[-3000:]}" for n, _, log in self.procs)

    def kill_all(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
                proc.wait(30)


@pytest.fixture
def relays(tmp_path: Path) -> Iterator[Relays]:
    r = Relays(tmp_path)
    try:
        yield r
    finally:
        r.kill_all()


@pytest.fixture
def env(pg_url: str, redis_url: str, namespace: str, tmp_home: Path) -> Iterator[dict[str, str]]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    e.update(OUTBOX_DATABASE_URL=pg_url, OUTBOX_BROKER_URL=redis_url, OUTBOX_NAMESPACE=namespace,
             OUTBOX_HOME=str(tmp_home), OUTBOX_RELAY_POLL_INTERVAL_S="0.5", OUTBOX_APP="relay.app",
             # no worker consumes here, so every published event looks lost to the reconciler after its window:
             # on a slow machine its re-sends (three per row) would compete with the drain these tests wait for
             OUTBOX_RELAY_RECONCILE_AFTER_MS="600000")
    yield e
    client = redis.Redis.from_url(redis_url)  # no worker consumes here: drop what the relays published
    keys = list(client.scan_iter(f"{namespace}*")) + list(client.scan_iter(f"_kombu.binding.{namespace}*"))
    if keys:
        client.delete(*keys)
    client.close()


def insert(sessions: sessionmaker[Session], tables: Tables, n: int, *, age_ms: int = 0,
           attempts: int = 0, due_in_ms: int = 0) -> int:
    """Commit ``n`` OrderPlaced rows created ``age_ms`` ago, due ``due_in_ms`` from now; returns now (ms)."""
    now = SystemClock().now_ms()
    with sessions() as s:
        s.add_all(tables.outbox(message_id=uuid.uuid4(), type="OrderPlaced", payload={"n": i}, headers={},
                                created_at_ms=now - age_ms, next_attempt_at_ms=now + due_in_ms, attempts=attempts,
                                last_error="nacked" if attempts else None) for i in range(n))
        s.commit()
    return now


def pending(sessions: sessionmaker[Session], tables: Tables) -> int:
    with sessions() as s:
        return int(s.scalar(sa.select(sa.func.count()).where(tables.outbox.published_at_ms.is_(None),
                                                             tables.outbox.next_attempt_at_ms <= SystemClock().now_ms()))
                   or 0)


def wait_for(cond: Callable[[], bool], what: str, relays: Relays, deadline_s: float = 90.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}\n{relays.logs()}")
        time.sleep(0.1)


def stats_cli(env: dict[str, str], *flags: str) -> tuple[int, dict[str, Any], str]:
    """``outbox stats --json FLAGS`` as the operator (or a cron probe) runs it: exit code, JSON, stderr."""
    r = subprocess.run([OUTBOX, "stats", "--json", *flags], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode in (0, 3), f"outbox stats failed ({r.returncode}): {r.stderr}"
    return r.returncode, json.loads(r.stdout), r.stderr


def thresholds(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in data["thresholds"]}


def gauge(sessions: sessionmaker[Session], tables: Tables, name: str) -> float:
    """One scrape of the library's /metrics text (what Prometheus reads), the value of gauge ``name``."""
    text = render(make_registry(tables=tables, session_factory=sessions)).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not exported:\n{text}")


def test_every_relay_stopped_trips_max_overdue_and_the_metric_but_backing_off_never_does(
        env: dict[str, str], pg_sessions: sessionmaker[Session], tables: Tables, relays: Relays) -> None:
    limit = f"--max-overdue={LIMIT_S}s"
    # Given a row that failed to publish 5 times an hour ago and backs off for another hour
    insert(pg_sessions, tables, 1, age_ms=3_600_000, attempts=5, due_in_ms=3_600_000)
    # And two real relays draining the outbox
    a, b = relays.start("relay-a", env), relays.start("relay-b", env)
    insert(pg_sessions, tables, 20)
    wait_for(lambda: pending(pg_sessions, tables) == 0, "the relays to publish the first rows", relays)
    # Then nothing is overdue: the backing-off row is an hour old but not due
    code, data, _ = stats_cli(env, limit, "--max-pending-age=30m")
    assert code == 3 and thresholds(data)["max_overdue_ms"]["crossed"] is False  # only the age threshold
    assert thresholds(data)["max_pending_age_ms"]["crossed"] is True
    assert gauge(pg_sessions, tables, "outbox_oldest_overdue_seconds") == 0

    # When every relay is stopped silently and 20 more rows are committed
    for proc in (a, b):
        os.killpg(proc.pid, signal.SIGSTOP)
    due_at = insert(pg_sessions, tables, 20)
    # Then the check sees them due but not yet over the limit
    code, data, _ = stats_cli(env, limit)
    assert data["outbox"]["due"] == 20
    assert code == 0 and thresholds(data)["max_overdue_ms"]["value"] < LIMIT_S * 1000

    # When the limit has passed with no relay publishing them
    wait_for(lambda: SystemClock().now_ms() > due_at + LIMIT_S * 1000, "the limit to pass", relays)
    code, data, err = stats_cli(env, limit)
    # Then outbox stats --max-overdue exits 3 saying why, and the metric reports the same wait
    assert code == 3, data
    t = thresholds(data)["max_overdue_ms"]
    assert t["crossed"] is True and t["value"] > LIMIT_S * 1000
    assert "no relay has published it" in err
    assert gauge(pg_sessions, tables, "outbox_oldest_overdue_seconds") > LIMIT_S
    assert pending(pg_sessions, tables) == 20  # nothing was published behind the check's back

    # When the relays continue, the backlog drains and the check is quiet again
    for proc in (a, b):
        os.killpg(proc.pid, signal.SIGCONT)
    wait_for(lambda: pending(pg_sessions, tables) == 0, "the resumed relays to drain", relays)
    code, data, _ = stats_cli(env, limit)
    assert code == 0 and thresholds(data)["max_overdue_ms"]["value"] is None
    assert gauge(pg_sessions, tables, "outbox_oldest_overdue_seconds") == 0


def stop_holding_a_claim(proc: subprocess.Popen[bytes], sessions: sessionmaker[Session], tables: Tables,
                         relays: Relays) -> int:
    """SIGSTOP ``proc`` at an instant it holds claimed rows (retrying at other instants); returns the claim's age.

    A claim seen once is not enough: a mark and its COMMIT the relay sent just before it stopped can still be
    on their way to the server, and that claim ends a moment later with nothing left held. The claim counts
    only when it is still open, and older, after a pause. Nor may the stopped transaction have marked yet:
    this test is about a held claim (a frozen mark no longer holds other relays' marks, since counters are
    striped: tests/integration/test_counters_striped.py).
    """
    for _ in range(200):
        os.killpg(proc.pid, signal.SIGSTOP)
        with sessions() as s:
            held = ops_stats.claim_held_ms(s, tables=tables)
            marked = s.execute(sa.text(
                "SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.relation = "
                "CAST(:counters AS regclass) AND l.mode = 'RowExclusiveLock' AND a.state LIKE 'idle in transaction%'"),
                {"counters": tables.table(tables.counters).name}).first() is not None
        if held is not None and not marked:
            time.sleep(0.5)
            with sessions() as s:
                later = ops_stats.claim_held_ms(s, tables=tables)
            if later is not None and later >= held + 400:
                return later
        os.killpg(proc.pid, signal.SIGCONT)
        time.sleep(0.02)
    pytest.fail(f"the relay was never caught holding a claim\n{relays.logs()}")


def still_held(sessions: sessionmaker[Session], tables: Tables) -> bool:
    with sessions() as s:
        return ops_stats.claim_held_ms(s, tables=tables) is not None


def test_a_relay_stopped_holding_its_claim_is_named_while_another_relay_drains(
        env: dict[str, str], pg_sessions: sessionmaker[Session], tables: Tables, relays: Relays) -> None:
    limits = (f"--max-claim-held={LIMIT_S}s", f"--max-overdue={LIMIT_S}s")
    # Given a relay publishing a backlog one row per batch, whose silent transactions Postgres ends after 90 s
    # (long enough for the drain and the checks below on a loaded machine: the claim must still be held then)
    stuck_env = {**env, "OUTBOX_DB_IDLE_IN_TRANSACTION_TIMEOUT_MS": str(IDLE_TIMEOUT_S * 1000)}
    stuck = relays.start("relay-stuck", stuck_env, "--batch-size", "1", "--max-in-flight", "1")
    insert(pg_sessions, tables, 3000)
    wait_for(lambda: pending(pg_sessions, tables) < 3000, "the relay to start publishing", relays)
    # When it is stopped silently between claiming rows and marking them
    stop_holding_a_claim(stuck, pg_sessions, tables, relays)
    # And another relay drains the rest
    relays.start("relay-ok", env)

    # Then everything but the stuck relay's rows is published (the other relay skips them)
    wait_for(lambda: pending(pg_sessions, tables) <= 2, "the healthy relay to drain the rest", relays,
             deadline_s=IDLE_TIMEOUT_S)
    assert still_held(pg_sessions, tables), f"the stuck claim ended before the drain did\n{relays.logs()}"
    assert pending(pg_sessions, tables) >= 1  # the stuck relay's batch (one row; two with one in flight)
    # And once the limit has passed, both checks exit 3 and name the stuck claim
    def crossed() -> bool:
        code, data, _ = stats_cli(env, *limits)
        return code == 3 and all(t["crossed"] for t in data["thresholds"])
    wait_for(crossed, "both thresholds to be crossed", relays, deadline_s=LIMIT_S + 60)
    assert still_held(pg_sessions, tables), f"the stuck claim ended before the checks ran\n{relays.logs()}"
    code, data, err = stats_cli(env, *limits)
    assert code == 3 and data["outbox"]["claim_held_ms"] > LIMIT_S * 1000
    assert "held its claimed rows" in err and "no relay has published it" in err
    assert gauge(pg_sessions, tables, "outbox_relay_claim_held_seconds") > LIMIT_S
    assert gauge(pg_sessions, tables, "outbox_oldest_overdue_seconds") > LIMIT_S

    # When Postgres ends the stopped relay's transaction (its idle-in-transaction timeout), its rows are released:
    # the healthy relay publishes them and every figure is quiet again
    wait_for(lambda: pending(pg_sessions, tables) == 0, "the released rows to be published", relays,
             deadline_s=IDLE_TIMEOUT_S + 60)
    code, data, _ = stats_cli(env, *limits)
    assert code == 0, data
    assert data["outbox"]["claim_held_ms"] is None and data["outbox"]["oldest_overdue_ms"] is None
    assert gauge(pg_sessions, tables, "outbox_relay_claim_held_seconds") == 0
