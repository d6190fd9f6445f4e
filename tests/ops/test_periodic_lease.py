"""The reconciler and retention run wherever the relay runs, once per interval however many run.

Standalone relays (``RelayLoop.periodic_jobs``, after every drain) and beat's ``celery_outbox.reconcile``
and ``celery_outbox.prune`` tasks share one database lease per job (``celery_outbox/relay/lease.py``).
Every test here drives a ManualClock: "an interval" is exact, never a wall-clock wait.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Outbox
from celery_outbox.celery.config import PRUNE_TASK, RECONCILE_TASK
from celery_outbox.clock import ManualClock
from celery_outbox.ops.schedule import DEFAULT_INBOX_RETENTION_MS as TASK_INBOX_DEFAULT
from celery_outbox.ops.schedule import DEFAULT_PUBLISHED_RETENTION_MS as TASK_PUBLISHED_DEFAULT
from celery_outbox.ops.schedule import PRUNE_EVERY_MS
from celery_outbox.relay import lease
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.schema import Tables
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings
from tests.outbox_rows import insert_pending

INTERVAL_S = 60
INTERVAL_MS = INTERVAL_S * 1000
HOUR_MS = 3600 * 1000
DAY_MS = 24 * HOUR_MS
ROUTES = {"OrderPlaced": ("shipping",)}


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The conftest's settings with this module's reconcile interval (beat's tasks read it from the outbox)."""
    return settings.replace(relay_reconcile_interval_s=INTERVAL_S)


def loop_on(sessions: sessionmaker[Session], clock: ManualClock, tables: Tables, tmp_path: Path,
            **overrides: Any) -> RelayLoop:
    settings = Settings(home=tmp_path, database_url="sqlite://", namespace="lease", relay_poll_interval_s=0.01,
                        relay_reconcile_interval_s=INTERVAL_S, **overrides)
    return RelayLoop(settings=settings, tables=tables, session_factory=sessions, publisher=InMemoryPublisher(),
                     clock=clock, routes=ROUTES, listen=False)


def lease_value(sessions: sessionmaker[Session], tables: Tables, job: str) -> int | None:
    with sessions() as s:
        return lease.next_due_ms(s, job, tables=tables)


def run_times(start_ms: int, clock: ManualClock, loops: list[RelayLoop], *, until_ms: int, step_ms: int,
              between: Callable[[int], None] | None = None) -> tuple[list[int], list[int]]:
    """Poll every loop (in turn) every ``step_ms`` until ``until_ms``; return when each job ran (ms after start)."""
    reconciles: list[int] = []
    prunes: list[int] = []
    order = random.Random(15)  # which relay polls first varies from step to step (seeded: reproducible)
    while clock.now_ms() - start_ms <= until_ms:
        for loop in order.sample(loops, len(loops)):
            before = (loop.stats.reconciles, loop.stats.prunes)
            loop.periodic_jobs()
            reconciles += [clock.now_ms() - start_ms] * (loop.stats.reconciles - before[0])
            prunes += [clock.now_ms() - start_ms] * (loop.stats.prunes - before[1])
        if between is not None:
            between(clock.now_ms() - start_ms)
        clock.advance(step_ms)
    return reconciles, prunes


def test_one_claimer_wins_a_due_lease_and_the_next_is_due_one_interval_later(
        any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    def claim(early_ms: int = 0) -> lease.Claim:
        with any_sessions() as s:
            return lease.claim(s, "job", interval_ms=INTERVAL_MS, clock=clock, tables=tables, early_ms=early_ms)

    # Given a job never claimed: the first claim wins at once, a second at the same instant loses
    t0 = clock.now_ms()
    assert claim() == lease.Claim(claimed=True, next_due_ms=t0 + INTERVAL_MS)
    assert claim() == lease.Claim(claimed=False, next_due_ms=t0 + INTERVAL_MS)
    # When the clock reaches one millisecond before the due instant, nobody wins
    clock.advance(INTERVAL_MS - 1)
    assert not claim().claimed
    # Then at the due instant one claimer wins and moves it exactly one interval on (not "now + interval")
    clock.advance(1)
    assert claim() == lease.Claim(claimed=True, next_due_ms=t0 + 2 * INTERVAL_MS)
    # And a timer-driven claimer may claim up to its tolerance early, still moving it one interval on
    clock.advance(INTERVAL_MS - 5)
    assert claim(early_ms=5) == lease.Claim(claimed=True, next_due_ms=t0 + 3 * INTERVAL_MS)
    # A claimer late by more than an interval re-anchors on now: no burst of catch-up runs
    clock.advance(5 * INTERVAL_MS)
    late = clock.now_ms()
    assert claim() == lease.Claim(claimed=True, next_due_ms=late + INTERVAL_MS)
    assert not claim().claimed
    # The lease is one row of the relay's counters, never read as a consumer's
    assert lease_value(any_sessions, tables, "job") == late + INTERVAL_MS


def test_many_claimers_at_the_same_instant_one_wins(any_sessions: sessionmaker[Session], clock: ManualClock,
                                                    tables: Tables) -> None:
    # Given eight claimers racing for a due lease, each with its own connection, released together
    def race() -> list[bool]:
        barrier = threading.Barrier(8)
        won: list[bool] = []
        guard = threading.Lock()

        def one() -> None:
            barrier.wait()
            with any_sessions() as s:
                got = lease.claim(s, "race", interval_ms=INTERVAL_MS, clock=clock, tables=tables).claimed
            with guard:
                won.append(got)

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        return won

    # When the lease does not exist yet (insert race), then when it is due again (update race)
    first = race()
    clock.advance(INTERVAL_MS)
    second = race()
    # Then each time exactly one of them won
    assert (len(first), first.count(True)) == (8, 1)
    assert (len(second), second.count(True)) == (8, 1)


def test_two_standalone_relays_on_one_database_run_each_job_once_per_interval(
        any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables, tmp_path: Path) -> None:
    # Given two standalone relays on the same database, both polling every 5 s for three hours
    loops = [loop_on(any_sessions, clock, tables, tmp_path / "a"), loop_on(any_sessions, clock, tables, tmp_path / "b")]
    start = clock.now_ms()
    # When each checks its periodic jobs after every poll
    reconciles, prunes = run_times(start, clock, loops, until_ms=3 * HOUR_MS, step_ms=5_000)
    # Then the reconciler ran exactly once per minute and retention exactly once per hour, in all
    assert reconciles == [k * INTERVAL_MS for k in range(3 * HOUR_MS // INTERVAL_MS + 1)]
    assert prunes == [k * PRUNE_EVERY_MS for k in range(4)]
    # And both relays took part (neither is a permanent leader), with no error
    assert all(loop.stats.reconciles > 0 for loop in loops)
    assert sum(loop.stats.errors for loop in loops) == 0
    for loop in loops:
        loop.close()


def test_a_crashed_holder_does_not_block_the_next_interval(any_sessions: sessionmaker[Session], clock: ManualClock,
                                                           tables: Tables, tmp_path: Path) -> None:
    # Given a relay that claimed the reconcile and prune leases and died before running either job
    start = clock.now_ms()
    for job, interval in ((lease.RECONCILE, INTERVAL_MS), (lease.PRUNE, PRUNE_EVERY_MS)):
        with any_sessions() as s:
            assert lease.claim(s, job, interval_ms=interval, clock=clock, tables=tables).claimed
    survivor = loop_on(any_sessions, clock, tables, tmp_path)
    # When another relay polls through the rest of that interval, nothing runs (the dead one had it)
    reconciles, prunes = run_times(start, clock, [survivor], until_ms=INTERVAL_MS - 1, step_ms=1_000)
    assert (reconciles, prunes) == ([], [])
    # Then at the next due instant the survivor runs each job: no stale lock to wait out
    clock.set(start + INTERVAL_MS)
    assert survivor.reconcile_if_due() is not None
    clock.set(start + PRUNE_EVERY_MS)
    assert survivor.prune_if_due() is not None
    assert (survivor.stats.prunes, survivor.stats.errors) == (1, 0)
    survivor.close()


def test_a_failing_pass_spends_its_interval_and_the_next_runs(any_sessions: sessionmaker[Session],
                                                               clock: ManualClock, tables: Tables, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    loop = loop_on(any_sessions, clock, tables, tmp_path)
    other = loop_on(any_sessions, clock, tables, tmp_path / "other")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("disk full")

    # Given a retention pass that fails (the relay holding the lease logs it and lives)
    monkeypatch.setattr("celery_outbox.relay.loop.scheduled_prune", broken)
    assert loop.prune_if_due() is None
    assert loop.stats.errors == 1 and "retention pass failed" in caplog.text
    monkeypatch.undo()
    # When another relay checks within the same hour, it does not run it again
    clock.advance(PRUNE_EVERY_MS - 1)
    assert other.prune_if_due() is None and loop.prune_if_due() is None
    # Then the next hour's pass runs, once
    clock.advance(1)
    assert other.prune_if_due() is not None
    assert loop.prune_if_due() is None
    loop.close()
    other.close()


def test_the_standalone_relay_prunes_with_the_beat_task_defaults(sqlite_sessions: sessionmaker[Session],
                                                                 clock: ManualClock, tables: Tables,
                                                                 tmp_path: Path) -> None:
    # Given a relay whose broker redelivery window is longer than the default inbox retention (30 d > 7 d)
    loop = loop_on(sqlite_sessions, clock, tables, tmp_path, broker_redelivery_window_ms=30 * DAY_MS)
    # When its retention pass runs
    report = loop.prune_if_due()
    # Then it used the beat task's defaults: inbox max(7 d, window), published rows 1 d
    assert report is not None
    assert report.inbox_cutoff_ms == clock.now_ms() - max(TASK_INBOX_DEFAULT, 30 * DAY_MS)
    assert report.outbox_cutoff_ms == clock.now_ms() - TASK_PUBLISHED_DEFAULT
    assert TASK_INBOX_DEFAULT == 7 * DAY_MS and TASK_PUBLISHED_DEFAULT == DAY_MS
    loop.close()


def test_the_standalone_relay_prunes_published_rows_a_day_old(sqlite_sessions: sessionmaker[Session],
                                                              clock: ManualClock, tables: Tables,
                                                              tmp_path: Path) -> None:
    loop = loop_on(sqlite_sessions, clock, tables, tmp_path)
    # Given one event the relay published, and a first retention pass that found nothing to delete
    insert_pending(sqlite_sessions, clock.now_ms(), 1, tables=tables)
    assert loop.drain_once().published == 1
    first = loop.prune_if_due()
    assert first is not None and first.outbox_deleted == 0
    # When a day and an hour go by, the relay polling every minute
    start = clock.now_ms()
    _, prunes = run_times(start, clock, [loop], until_ms=DAY_MS + HOUR_MS, step_ms=60_000)
    # Then it pruned once an hour, and the published row is gone
    assert prunes == [k * PRUNE_EVERY_MS for k in range(1, 26)]
    with sqlite_sessions() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(tables.outbox)) == 0
    loop.close()


def beat_result(outbox: Outbox, task: str) -> dict[str, Any]:
    result: dict[str, Any] = outbox.app.tasks[task].apply().get()
    return result


def test_beat_ticks_that_arrive_a_little_early_or_late_are_never_skipped(outbox: Outbox, clock: ManualClock) -> None:
    # Given beat alone: its reconcile task reaches the worker every interval, give or take a queueing
    # delay that varies from tick to tick (here up to 5 s either way, within the tolerance of 6 s)
    start = clock.now_ms()
    jitter = [0, -5_000, 5_000, -5_000, 0, 4_000, -4_000, 5_000, -5_000, 0]
    ran = []
    for k, delay in enumerate(jitter):
        clock.set(start + k * INTERVAL_MS + delay)
        # When each tick runs the task
        ran.append("skipped" not in beat_result(outbox, RECONCILE_TASK))
    # Then every tick ran its pass
    assert ran == [True] * len(jitter)
    assert lease.timer_tolerance_ms(INTERVAL_MS) == 6_000


def test_beat_and_a_standalone_relay_together_run_each_job_once_per_interval(
        outbox: Outbox, sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables,
        tmp_path: Path) -> None:
    loop = loop_on(sqlite_sessions, clock, tables, tmp_path)  # the outbox fixture's database
    tolerance = lease.timer_tolerance_ms(INTERVAL_MS)
    beat_reconciles: list[int] = []
    beat_prunes: list[int] = []

    def beat(t: int) -> None:
        # beat's tasks reach the worker 3 s before the relay would claim (within beat's tolerance)
        if t % INTERVAL_MS == INTERVAL_MS - 3_000 and "skipped" not in beat_result(outbox, RECONCILE_TASK):
            beat_reconciles.append(t)
        if t % PRUNE_EVERY_MS == PRUNE_EVERY_MS - 3_000 and "skipped" not in beat_result(outbox, PRUNE_TASK):
            beat_prunes.append(t)

    # Given beat and a standalone relay polling every second, on one database, for two hours
    start = clock.now_ms()
    reconciles, prunes = run_times(start, clock, [loop], until_ms=2 * HOUR_MS, step_ms=1_000, between=beat)
    # Then, counting both, each job ran exactly once per interval
    everything = sorted(reconciles + beat_reconciles)
    assert len(everything) == 2 * HOUR_MS // INTERVAL_MS + 1
    assert [round(t / INTERVAL_MS) for t in everything] == list(range(len(everything)))
    assert all(b - a >= INTERVAL_MS - tolerance for a, b in itertools.pairwise(everything))
    assert sorted(prunes + beat_prunes) == [0, PRUNE_EVERY_MS - 3_000, 2 * PRUNE_EVERY_MS - 3_000]
    # And both took part: the relay's first pass at start, beat's every one after
    assert reconciles == [0] and prunes == [0]
    loop.close()


def test_a_one_off_prune_with_explicit_ages_ignores_the_lease(outbox: Outbox, clock: ManualClock) -> None:
    # Given this hour's scheduled retention already ran
    assert "skipped" not in beat_result(outbox, PRUNE_TASK)
    assert "skipped" in beat_result(outbox, PRUNE_TASK)
    # When someone sends the task with an explicit age (a one-off, like `outbox prune`)
    result: dict[str, Any] = outbox.app.tasks[PRUNE_TASK].apply(kwargs={"published_older_than_ms": 1000}).get()
    # Then it runs at once
    assert "skipped" not in result and result["outbox_cutoff_ms"] == clock.now_ms() - 1000
