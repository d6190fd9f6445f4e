"""A real ``celery beat`` SIGKILLed and restarted from its stale schedule file, its periodic task through the
outbox (docs/scheduled.md, "Periodic tasks"): every period from the first tick to the last is run once, none
twice, none lost. A real relay (``outbox relay``) and worker (Redis) run the ticks.

Beat's schedule file is synced every 3 minutes (Celery's default), so a beat killed after a tick restarts
with the tick's ``last_run_at`` lost and fires again at once: plain beat sends that tick twice; through the
outbox the second write of the period is the same task id and writes nothing.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_outbox.celery import beat
from devtools.processes import Child, wait_until
from tests.tasks.beatapp import BeatApp, build

pytestmark = [pytest.mark.workers, pytest.mark.slow, pytest.mark.redis]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
EVERY_S = 6


def ticks(t: BeatApp) -> list[str]:
    o = t.outbox.tables.outbox
    with t.sessions() as s:
        return [h[beat.TICK_HEADER] for h in s.execute(sa.select(o.headers).order_by(o.seq)).scalars()]


def test_beat_killed_and_restarted_never_loses_or_doubles_a_tick(redis_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    queue = f"beat.{uuid.uuid4().hex[:10]}"
    env.update({"BEATAPP_DATABASE_URL": f"sqlite:///{tmp_path / 'beat.db'}", "PYTHONPATH": str(ROOT),
                "BEATAPP_QUEUE": queue, "BEATAPP_BROKER_URL": redis_url, "BEATAPP_EVERY_S": str(EVERY_S)})
    t = build(redis_url, env["BEATAPP_DATABASE_URL"], queue, every_s=EVERY_S)
    t.create_schema()
    schedule = tmp_path / "beat-schedule"

    def start_beat(n: int) -> Child:
        return Child(name=f"beat{n}", cwd=ROOT, env=env, log_path=tmp_path / f"beat{n}.log", argv=[
            sys.executable, "-m", "celery", "-A", "tests.tasks.beatapp", "beat", "-s", str(schedule),
            "--max-interval", "1", "-l", "INFO"]).start()

    worker = Child(name="worker", cwd=ROOT, env=env, log_path=tmp_path / "worker.log", argv=[
        sys.executable, "-m", "celery", "-A", "tests.tasks.beatapp", "worker", "-Q", queue, "-P", "solo",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO", "-n", f"{queue}@%h"]).start()
    relay = Child(name="relay", cwd=ROOT, env=env, log_path=tmp_path / "relay.log",
                  argv=[str(BIN / "outbox"), "-A", "tests.tasks.beatapp", "relay", "--no-listen"]).start()
    # start beat just after a period begins, so its ticks fall early in their periods and a restart right
    # after one fires within the same period (the double plain beat would send)
    time.sleep(EVERY_S - time.time() % EVERY_S + 0.2)
    beat1 = start_beat(1)
    beat2: Child | None = None
    try:
        # Given beat ran two ticks through the outbox
        assert wait_until(lambda: len(ticks(t)) >= 2, timeout_s=60), beat1.log_tail()
        # When it is SIGKILLed right after a tick and restarted from its schedule file
        n = len(ticks(t))
        assert wait_until(lambda: len(ticks(t)) > n, timeout_s=30), beat1.log_tail()
        beat1.kill()
        beat2 = start_beat(2)
        # and three more periods pass
        assert wait_until(lambda: len(ticks(t)) >= n + 4, timeout_s=60), beat2.log_tail()
        beat2.stop()
        written = ticks(t)
        assert wait_until(lambda: len(t.runs()) >= len(written), timeout_s=30), worker.log_tail() + relay.log_tail()
        time.sleep(2)  # an absence check: a second run would come within this
        # Then each period from the first tick to the last has one row and one run: none lost, none doubled
        slots = [int(k.rsplit(":", 1)[1]) for k in written]
        assert slots == list(range(slots[0], slots[-1] + 1, EVERY_S * 1000)), (written, beat2.log_tail())
        assert set(Counter(r.task_id for r in t.runs()).values()) == {1}
        assert len(t.runs()) == len(written)
        restarted = beat2.log_path.read_text(errors="replace")
        print("restarted beat re-sent a tick it had already written:", "already in the outbox" in restarted)
    finally:
        beat1.kill()
        if beat2 is not None:
            beat2.kill()
        relay.stop()
        worker.stop()
