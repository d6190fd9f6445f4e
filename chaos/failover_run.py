"""Failover runs: orders through the reference deployment while the database's primary, or the broker's,
is SIGKILLed and a replica takes over. Real processes, as in a chaos run (chaos/environment.py): an
order writer that retries what failed (``chaos.failover_load``), one ``outbox relay`` and two
``celery worker`` processes, each given ONE URL for the whole run and never restarted.

``run_pg_failover`` (chaos/pg_pair.py): the database is a primary and its streaming standby behind a
multi-host URL (``target_session_attrs=read-write``). At a third of the orders the standby's WAL
stream is paused (``replication="async"``: the primary goes on committing, as an asynchronous
primary does; ``"sync"``: with a synchronous standby the commits wait instead), about a second later
the primary is SIGKILLed, the standby promoted. The run then waits for quiescence and reads the new
primary:

- ``lost_commits``: orders the writer saw committed that are gone. Asynchronous replication loses
  the commits the standby never received, an order with its outbox rows (one transaction, one WAL
  record stream), never one without the other (``orphans`` counts either without the other);
  synchronous replication loses none.
- every order present: exactly one effect per consumer and one e-mail (chaos/invariants.py).
- ``ghost_effects``: effects for an order that is gone. The consumers' inbox and effect tables live
  in the same database and fail over with it, but the broker does not: a message the relay published
  from a commit the standby never received is delivered after the failover, and its effect is
  committed on the new primary. Synchronous replication closes this (a commit becomes visible, to the
  relay too, only once the standby has it); asynchronous replication leaves it open, and the run
  counts it. A consumer that reads the order instead of trusting the event (the deployment's
  confirmation e-mail task) refuses such a message: it ends in the dead-letter store
  (``ghost_dead_letters``).

``run_sentinel_failover`` (chaos/sentinel.py): the broker is a Redis primary and replica watched by three
sentinels, every process on the ``sentinel://`` URL; see its docstring.

Used by tests/production/test_pg_failover.py, tests/production/test_redis_sentinel.py and
bench/failover.py (figures in docs/deployment.md).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from celery_outbox.messages import encode_json
from celery_outbox.schema import Tables
from chaos import invariants
from chaos.environment import REPO, ChaosEnvironment
from chaos.load import make_plan
from chaos.pg_pair import PgPair
from chaos.processes import ManagedProcess, frozen
from chaos.sentinel import MASTER, SentinelBroker, SentinelGroup
from consumers.models import Shipment
from orders.models import Order

Progress = Callable[[str], None]
REPLICATION = ("async", "sync")


@dataclass(kw_only=True)
class Recovery:
    """Seconds from the primary's SIGKILL until each kind of process got something done again."""

    promote_s: float = 0.0  # pg_ctl promote, until the standby accepts writes
    writer_s: float | None = None  # the first order commit after the kill
    relay_s: float | None = None  # the first row published after the kill
    workers_s: float | None = None  # the first shipment committed after the kill


@dataclass(kw_only=True)
class FailoverReport:
    engine: str
    orders: int
    replication: str = ""
    faults: list[str] = field(default_factory=list)
    committed_seen: int = 0  # orders the writer saw committed
    present: int = 0  # orders in the database at the end
    lost_commits: int = 0  # seen committed, gone after the failover
    lost_in_window: int = 0  # of which committed while the WAL stream was paused
    orphans: int = 0  # an order without its outbox rows, or rows without their order
    lost: int = 0  # (present order, consumer or e-mail) pairs without an effect
    doubled: int = 0  # effects beyond one for an (order, consumer or e-mail)
    ghost_effects: int = 0  # effects for orders that are gone
    ghost_dead_letters: int = 0  # dead letters of messages whose outbox row is gone (a consumer refused them)
    resent: int = 0  # messages the reconciler published again
    published_in_window: int = 0  # rows marked published while replication was paused (their messages at risk)
    duplicates_absorbed: int = 0
    writer_errors: int = 0  # failed order attempts (retried) during the failover
    recovery: Recovery = field(default_factory=Recovery)
    # order commit -> its shipment committed, ms: p50/p99 of the orders before the fault, and of every order
    latency_ms: dict[str, dict[str, int]] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    unexpected_exits: list[str] = field(default_factory=list)
    quiesced: bool = False
    duration_s: float = 0.0
    drain_s: float = 0.0
    url_form: str = ""
    setup_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.quiesced and not self.violations and not self.unexpected_exits

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _tolerant(fn: Callable[[], Any], default: Any) -> Any:
    """``fn()``, or ``default`` while the database is away (the run's own reads live through the failover)."""
    try:
        return fn()
    except sa.exc.DBAPIError:
        return default


def _first_after(env: ChaosEnvironment, stmt_of: Callable[[int], Any], *, since_ms: int, timeout_s: float
                 ) -> float | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        first = _tolerant(lambda: env.scalar(stmt_of(since_ms)), None)
        if first is not None:
            return max(0.0, (int(first) - since_ms) / 1000)
        time.sleep(0.2)
    return None


def _writer(env: ChaosEnvironment, plan: Sequence[dict[str, Any]], *, interval_ms: int, committed: Path
            ) -> ManagedProcess:
    path = env.workdir / "failover-plan.json"
    path.write_text(encode_json(list(plan)))
    argv = [sys.executable, "-m", "chaos.failover_load", "--plan", str(path), "--committed", str(committed),
            "--interval-ms", str(interval_ms)]
    return env.processes.add(ManagedProcess(name="orders", argv=argv, env=env.env, log_dir=env.workdir / "logs",
                                            cwd=REPO))


def _read_committed(path: Path) -> dict[str, int]:
    seen: dict[str, int] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            order_id, _, ms = line.partition("\t")
            if ms:
                seen[order_id] = int(ms)
    return seen


def _settle(env: ChaosEnvironment, report: FailoverReport, procs: Sequence[ManagedProcess], *,
            timeout_s: float) -> None:
    """Wait for quiescence (nothing pending, every order recorded by every consumer), noting exits."""

    def done() -> bool:
        def read() -> bool:
            with env.sessions() as s:
                return invariants.quiescent(s, tables=env.tables, consumers=env.consumers, expected_dead_letters=0)
        return bool(_tolerant(read, False))

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done():
        time.sleep(0.5)
    report.quiesced = done()
    for proc in procs:
        if not proc.alive():
            report.unexpected_exits.append(f"{proc.name} exited {proc.returncode()} during the run")


def _latency(env: ChaosEnvironment, report: FailoverReport, *, fault_ms: int) -> None:
    """Order commit -> shipment committed, before the fault and over the whole run (the same run)."""
    with env.sessions() as s:
        rows = s.execute(sa.select(Order.created_at_ms, Shipment.created_at_ms)
                         .join(Shipment, Shipment.order_id == Order.id)).all()

    def pct(values: list[int]) -> dict[str, int]:
        if not values:
            return {}
        values.sort()
        return {"p50": values[len(values) // 2], "p99": values[min(len(values) - 1, int(len(values) * 0.99))],
                "n": len(values)}

    report.latency_ms = {"before_fault": pct([int(e - c) for c, e in rows if c < fault_ms]),
                         "all": pct([int(e - c) for c, e in rows])}


def _tally(env: ChaosEnvironment, report: FailoverReport, *, seen: dict[str, int]) -> set[str]:
    """Effects per present order (lost, doubled), ghosts, orphans, re-sends: from the database alone.
    Returns the ids of the orders that are gone."""
    time.sleep(1.0)  # a late duplicate lands before the final read
    outbox = env.tables.outbox
    with env.sessions() as s:
        present = {str(o) for o in s.execute(sa.select(Order.id)).scalars()}
        by_order = invariants.effect_counts_by_order(s, tables=env.tables)
        events = invariants.order_message_ids(s, tables=env.tables)
        tasks = invariants.confirmation_task_ids(s, tables=env.tables)
        check = invariants.check(s, tables=env.tables, consumers=env.consumers, rolled_back=[], poison=[],
                                 now_ms=int(time.time() * 1000))
        report.resent = invariants.reconciled(s, tables=env.tables)
        report.duplicates_absorbed = check.snapshot.duplicates_absorbed
        pending = s.execute(sa.select(sa.func.count()).select_from(outbox).where(
            outbox.published_at_ms.is_(None), outbox.dead_lettered_at_ms.is_(None))).scalar_one()
    gone = set(seen) - present
    report.present = len(present)
    report.lost_commits = len(gone)
    rows_of = {*events.values(), *tasks.values()}
    report.orphans = len(rows_of - present) + sum(
        1 for o in present if list(events.values()).count(o) != 1 or list(tasks.values()).count(o) != 1)
    for counts in by_order.values():
        report.lost += sum(1 for o in present if counts.get(o, 0) == 0)
        report.doubled += sum(n - 1 for n in counts.values() if n > 1)
        report.ghost_effects += sum(n for o, n in counts.items() if o not in present)
    if pending:
        report.violations.append(f"{pending} outbox row(s) still pending")
    # The invariants' own "no effect without a committed order" is what ``ghost_effects`` counts; the rest
    # (one effect per present order, rows with their order, nothing pending or dead-lettered) must hold.
    # A dead letter is wrong unless its message came from a commit the failover lost (its outbox row is
    # gone): a consumer that reads the order refuses such a message, and a person must look.
    with env.sessions() as s:
        dead = [str(mid) for (mid,) in s.execute(sa.select(env.tables.dead_letters.message_id)).all()]
    known = {str(m) for m in (*events, *tasks)}  # the dead-letter store keeps ids as text
    report.ghost_dead_letters = sum(1 for mid in dead if mid not in known)
    wrong_dead = [mid for mid in dead if mid in known]
    if wrong_dead:
        report.violations.append(f"{len(wrong_dead)} dead letter(s) of present orders: {', '.join(wrong_dead[:5])}")
    report.violations += [f"{v.invariant}: {v.detail}" for v in check.violations
                          if "no effect without a committed order" not in v.invariant
                          and not v.invariant.startswith("dead letters")]
    return gone


def run_pg_failover(*, pair: PgPair, orders: int, workdir: Path, tables: Tables | None = None,
                    replication: str = "async", writer_s: float = 30.0, pause_s: float = 1.0,
                    timeout_s: float = 180.0, progress: Progress | None = None) -> FailoverReport:
    """See the module docstring. ``pair`` is started and not yet failed over."""
    if replication not in REPLICATION:
        from celery_outbox.errors import ConfigError

        raise ConfigError(f"replication must be one of {', '.join(REPLICATION)}, got {replication!r}")
    say = progress or (lambda _m: None)
    interval_ms = max(1, int(writer_s * 1000 / max(orders, 1)))
    report = FailoverReport(engine="postgres", orders=orders, replication=replication,
                            url_form="postgresql://user@/db?host=10.0.0.1:5432&host=10.0.0.2:5432"
                                     "&target_session_attrs=read-write")
    started = time.monotonic()
    if replication == "sync":
        pair.set_synchronous(True)
    plan = make_plan(orders, prefix="pf")
    committed = workdir / "committed.tsv"
    env = ChaosEnvironment(broker="redis", workdir=workdir, pg_admin_url=pair.url(), tables=tables)
    with env:
        report.setup_s = time.monotonic() - started
        relay, w1, w2 = env.relay("relay"), env.worker("worker-1"), env.worker("worker-2")
        writer = _writer(env, plan, interval_ms=interval_ms, committed=committed)
        for proc in (relay, w1, w2, writer):
            proc.start()
        say(f"database {env.db_name} on {pair.url(env.db_name)}, logs {workdir / 'logs'}")
        env.wait(lambda: len(_read_committed(committed)) >= orders // 3 or not writer.alive(), timeout_s=timeout_s,
                 what=f"{orders // 3} orders committed")
        with frozen((w1, w2)):  # what the relay publishes meanwhile waits in the broker, not in a lost effect
            pair.pause_replication()
            paused_ms = int(time.time() * 1000)
            say(f"WAL stream to the standby paused at {len(_read_committed(committed))} committed orders "
                f"({replication}), workers frozen")
            time.sleep(pause_s)
            kill_ms = int(time.time() * 1000)
            pair.kill_primary()
            report.faults.append(f"primary SIGKILLed after {pause_s:.1f}s with its WAL stream paused "
                                 f"({replication}), the workers frozen until the standby was promoted")
            report.recovery.promote_s = pair.promote()
        say(f"primary killed, standby promoted in {report.recovery.promote_s:.2f}s")
        if replication == "sync":
            pair.set_synchronous(False, on=pair.primary)  # no standby left to wait for
        rec = report.recovery
        rec.writer_s = next((max(0.0, (ms - kill_ms) / 1000) for ms in sorted(_read_committed(committed).values())
                             if ms > kill_ms), None)
        outbox = env.tables.outbox
        rec.relay_s = _first_after(env, lambda t: sa.select(sa.func.min(outbox.published_at_ms))
                                   .where(outbox.published_at_ms > t), since_ms=kill_ms, timeout_s=60)
        rec.workers_s = _first_after(env, lambda t: sa.select(sa.func.min(Shipment.created_at_ms))
                                     .where(Shipment.created_at_ms > t), since_ms=kill_ms, timeout_s=60)
        code = writer.wait_exit(timeout_s=timeout_s)
        if code != 0:
            report.unexpected_exits.append(f"order writer exited {code}")
        seen = _read_committed(committed)
        if rec.writer_s is None:
            rec.writer_s = next((max(0.0, (ms - kill_ms) / 1000) for ms in sorted(seen.values()) if ms > kill_ms),
                                None)
        last_order = time.monotonic()
        _settle(env, report, (relay, w1, w2), timeout_s=timeout_s)
        report.drain_s = time.monotonic() - last_order
        report.committed_seen = len(seen)
        report.writer_errors = sum(1 for line in writer.log_path.read_text(errors="replace").splitlines()
                                   if line.startswith("order "))
        gone = _tally(env, report, seen=seen)
        _latency(env, report, fault_ms=paused_ms)
        report.lost_in_window = sum(1 for o in gone if seen[o] >= paused_ms)
        if not report.ok:
            say(env.logs())
    report.duration_s = time.monotonic() - started
    return report


def run_sentinel_failover(*, group: SentinelGroup, orders: int, workdir: Path, tables: Tables | None = None,
                          writer_s: float = 30.0, pause_s: float = 1.0, timeout_s: float = 180.0,
                          progress: Progress | None = None) -> FailoverReport:
    """Redis behind Sentinel (chaos/sentinel.py): the writer, the relay and two workers on the group's
    ``sentinel://`` URL with its master's name. At a third of the orders the workers are frozen and the
    replica's stream paused, so what the relay publishes for about a second reaches the primary only; then
    the primary is SIGKILLed, and so is worker 2 (frozen, holding whatever it had taken); the sentinels
    promote the replica, worker 1 resumes, worker 2 is started again. The messages of that second are
    gone from Redis while their rows are marked published: only the reconciler can bring them back
    (``resent``). Then quiescence, and from the database: every order's effects exactly once."""
    say = progress or (lambda _m: None)
    interval_ms = max(1, int(writer_s * 1000 / max(orders, 1)))
    report = FailoverReport(engine="redis-sentinel", orders=orders, replication="async",
                            url_form="sentinel://:pass@s1:26379/0;sentinel://:pass@s2:26379/0;"
                                     "sentinel://:pass@s3:26379/0 + OUTBOX_BROKER_SENTINEL_MASTER")
    started = time.monotonic()
    plan = make_plan(orders, prefix="sf")
    committed = workdir / "committed.tsv"
    env = ChaosEnvironment(broker="redis", workdir=workdir, tables=tables, extra_env=SentinelBroker.ENV,
                           broker_impl=SentinelBroker(group))
    with env:
        report.setup_s = time.monotonic() - started
        relay, w1, w2 = env.relay("relay"), env.worker("worker-1"), env.worker("worker-2")
        writer = _writer(env, plan, interval_ms=interval_ms, committed=committed)
        for proc in (relay, w1, w2, writer):
            proc.start()
        say(f"database {env.db_name}, broker {group.url} (master {MASTER}), logs {workdir / 'logs'}")
        env.wait(lambda: len(_read_committed(committed)) >= orders // 3 or not writer.alive(), timeout_s=timeout_s,
                 what=f"{orders // 3} orders committed")
        outbox = env.tables.outbox
        old_port = group.master_port() or 0
        with frozen((w1, w2)):
            group.pause_replication()
            paused_ms = int(time.time() * 1000)
            time.sleep(pause_s)
            kill_ms = int(time.time() * 1000)
            group.kill_primary()
            w2.kill()
            report.faults.append(f"Redis primary SIGKILLed after {pause_s:.1f}s with its replication paused and the "
                                 "workers frozen; worker 2 SIGKILLed with it")
            report.recovery.promote_s = group.wait_failover(old_port)
        w2.start()
        window = report.published_in_window = env.count(outbox, outbox.published_at_ms >= paused_ms,
                                                        outbox.published_at_ms <= kill_ms)
        say(f"primary killed with {window} row(s) published while replication was paused; sentinels promoted the "
            f"replica in {report.recovery.promote_s:.2f}s")
        rec = report.recovery
        rec.relay_s = _first_after(env, lambda t: sa.select(sa.func.min(outbox.published_at_ms))
                                   .where(outbox.published_at_ms > t), since_ms=kill_ms, timeout_s=60)
        rec.workers_s = _first_after(env, lambda t: sa.select(sa.func.min(Shipment.created_at_ms))
                                     .where(Shipment.created_at_ms > t), since_ms=kill_ms, timeout_s=60)
        code = writer.wait_exit(timeout_s=timeout_s)
        if code != 0:
            report.unexpected_exits.append(f"order writer exited {code}")
        seen = _read_committed(committed)
        rec.writer_s = next((max(0.0, (ms - kill_ms) / 1000) for ms in sorted(seen.values()) if ms > kill_ms), None)
        last_order = time.monotonic()
        _settle(env, report, (relay, w1, w2), timeout_s=timeout_s)
        report.drain_s = time.monotonic() - last_order
        report.committed_seen = len(seen)
        report.writer_errors = sum(1 for line in writer.log_path.read_text(errors="replace").splitlines()
                                   if line.startswith("order "))
        _tally(env, report, seen=seen)
        _latency(env, report, fault_ms=paused_ms)
        if report.lost_commits or report.ghost_effects or report.ghost_dead_letters:
            report.violations.append(f"the database lost nothing here, yet {report.lost_commits} order(s) are gone, "
                                     f"{report.ghost_effects} ghost effect(s), {report.ghost_dead_letters} ghost "
                                     "dead letter(s)")
        if not report.ok:
            say(env.logs())
    report.duration_s = time.monotonic() - started
    return report
