"""``run_chaos``: the whole failure matrix in one run, with real processes and real SIGKILLs.

Against a Postgres database of its own and a real broker it runs the order writer, a relay and two
workers as subprocesses; arms them with crash points from a seeded kill plan and, each time one dies
by SIGKILL, restarts it armed with the next; takes the broker away once mid-run and brings it back;
runs a second relay for a while; injects poison messages and duplicate deliveries; loses messages
in the take window (below); freezes the database for a few seconds (the processes reach Postgres
through a loopback proxy that stops forwarding, connections kept: a stalled server); waits for
quiescence; and checks chaos/invariants.py. The same seed gives the same plan (which orders fail,
which crash points in which order, which consumers get poison, when beat dies); process timing is
real, so what each kill hits varies, and the invariants must hold whatever it hits.

The relay runs in one of the deployment's two shapes: ``standalone`` (``outbox relay`` processes) or
``beat`` (``celery beat`` schedules the drain and reconcile tasks, ``celery worker`` processes of the
relay queue run them). With beat, beat itself is SIGKILLed at random moments and restarted.

The take window: kombu's Redis transport takes a message (``BRPOP``) before it records it as unacked,
so a worker SIGKILLed between the two loses it for good on the broker's side, after its row was
marked published. A kill almost never lands in that microsecond window, so the run provokes the
state it leaves instead, deterministically: with the consumer workers frozen (SIGSTOP), it removes a
just-published message whose row is marked from the ``<ns>.email`` queue (the confirmation e-mail
task) and from one consumer's queue, before any worker took it (chaos/broker.py; on RabbitMQ, where
such a kill loses nothing, a message acknowledged and never processed). Only the reconciler can bring
these back; the invariant "taken and lost: re-sent and recorded" checks that it did.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa

from chaos import invariants
from chaos.environment import PG_ADMIN_URL, ChaosEnvironment
from chaos.figures import FaultFigures, fault_figures
from chaos.matrix import MatrixRow, verdict, violated
from chaos.processes import ManagedProcess, frozen
from orders.models import Order

ROLE_POINTS: dict[str, tuple[str, ...]] = {
    "relay": ("after_claim_before_publish", "after_publish_before_mark", "after_mark"),
    "worker": ("consumer_before_commit", "consumer_after_commit_before_ack"),
    "orders": ("after_order_commit",),
}

RELAY_MODES = ("standalone", "beat")
TAKE_WAIT_S = 10.0  # how long one take-window round waits for a message to lose (workers frozen)

Progress = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class LostMessage:
    """A message the run removed from the broker in the take window (``delivery``: a consumer or ``email``)."""

    delivery: str
    message_id: str

    @property
    def inbox_consumer(self) -> str:
        """Who records it in the inbox: the consumer, or the e-mail task's ``task:<name>`` key."""
        return invariants.CONFIRMATION_KEY if self.delivery == invariants.EMAIL else self.delivery


@dataclass(kw_only=True)
class ChaosReport:
    broker: str
    seed: int
    orders: int
    kills_requested: int
    kills: Counter[str] = field(default_factory=Counter)  # crash point -> SIGKILLs observed
    armed_not_reached: list[str] = field(default_factory=list)
    unexpected_exits: list[str] = field(default_factory=list)
    rolled_back: int = 0
    poison: int = 0
    duplicates_injected: int = 0
    relay_mode: str = "standalone"
    taken_and_lost: list[LostMessage] = field(default_factory=list)
    take_rounds: int = 0  # rounds planned: each loses one e-mail task and one event
    take_how: str = ""
    beat_kills: int = 0  # SIGKILLs of beat at random moments (beat mode)
    beat_kills_planned: int = 0
    outage: str = ""
    outage_s: float = 0.0
    outage_peak_pending: int = 0
    peak_pending: int = 0
    peak_oldest_pending_age_ms: int = 0
    second_relay_s: float = 0.0
    quiesced: bool = False
    duration_s: float = 0.0
    workdir: str = ""
    invariants: invariants.InvariantReport | None = None
    matrix: list[MatrixRow] = field(default_factory=list)
    db_freeze_s: float = 0.0  # how long the processes' connections to Postgres stalled (0: not provoked)
    db_freeze_connections: int = 0  # connections open or opened while it lasted
    figures: list[FaultFigures] = field(default_factory=list)  # loss and duplicates per fault (chaos/figures.py)
    consumers_stop_s: float = 0.0  # how long the consumer workers were stopped (SIGSTOP) while orders kept coming
    consumers_stop_peak_queued: int = 0  # the most messages their queues held meanwhile
    resent: list[LostMessage] = field(default_factory=list)  # what the reconciler published again (its log lines)
    email_provider_calls: int = 0  # calls of the e-mail provider (keys are idempotent: e-mails sent once)

    @property
    def resent_not_lost(self) -> list[LostMessage]:
        """Re-sends of messages the run did not remove from the broker: the only losses it provokes (a Redis
        server is killed only once its queues are empty), so each of these was late, not lost."""
        taken = {(m.delivery, m.message_id) for m in self.taken_and_lost}
        return [m for m in self.resent if (m.delivery, m.message_id) not in taken]

    @property
    def ok(self) -> bool:
        return (self.invariants is not None and self.invariants.ok and self.quiesced
                and not self.unexpected_exits)


def plan_kills(kills: int, rng: random.Random) -> dict[str, deque[str]]:
    """``kills`` crash-point specs (``name@N``), cycling over every point so each gets its turn."""
    points = [(role, p) for role, ps in ROLE_POINTS.items() for p in ps]
    rng.shuffle(points)
    queues: dict[str, deque[str]] = {role: deque() for role in ROLE_POINTS}
    for i in range(kills):
        role, point = points[i % len(points)]
        queues[role].append(f"{point}@{rng.randint(1, 3)}")
    return queues


def plan_fractions(n: int, rng: random.Random, *, lo: float, hi: float) -> list[float]:
    """``n`` moments of the order stream (fractions of it), one drawn in each of ``n`` equal slices of
    [lo, hi): spread over the run however many there are."""
    width = (hi - lo) / max(n, 1)
    return [lo + width * (i + rng.random()) for i in range(n)]


def plan_takes(n: int, rng: random.Random) -> list[float]:
    """When the ``n`` take-window rounds happen: the first half before the broker outage (which begins
    at half the stream), the rest after it, so each finds the broker up and traffic flowing."""
    first = (n + 1) // 2
    return plan_fractions(first, rng, lo=0.1, hi=0.45) + plan_fractions(n - first, rng, lo=0.55, hi=0.9)


def lose_in_take_window(env: ChaosEnvironment, *, workers: Sequence[ManagedProcess], deliveries: Sequence[str],
                        exclude: set[str], wait_s: float = TAKE_WAIT_S) -> list[LostMessage]:
    """Freeze the consumer workers and remove one published message of each of ``deliveries`` from the
    broker (``ChaosEnvironment.take_and_lose``), not one of ``exclude``; thaw them. Returns what was lost
    (fewer than asked if a queue got nothing to take within ``wait_s``)."""
    lost: list[LostMessage] = []
    remaining = list(deliveries)
    with frozen(workers):
        deadline = time.monotonic() + wait_s
        while remaining and time.monotonic() < deadline:
            for delivery in list(remaining):
                taken = env.take_and_lose(delivery, exclude=exclude)
                if taken is not None:
                    lost.append(LostMessage(delivery=delivery, message_id=taken.message_id))
                    exclude.add(taken.message_id)
                    remaining.remove(delivery)
            if remaining:
                time.sleep(0.1)
    return lost


RESENT_LINE = re.compile(r"reconcile: (event|task|plain task) (\S+) never reached (\S+); published again")


def resent_in_logs(log_dir: Path) -> list[LostMessage]:
    """Every re-send the reconciler logged (relay/reconcile.py, one WARNING line per message) in the run's
    process logs: the e-mail task's as ``email``, an event's under its consumer."""
    found: list[LostMessage] = []
    for path in sorted(log_dir.glob("*")):
        if not path.is_file():
            continue
        for match in RESENT_LINE.finditer(path.read_text(errors="replace")):
            kind, message_id, target = match.groups()
            delivery = invariants.EMAIL if kind != "event" and target == invariants.CONFIRMATION else target
            found.append(LostMessage(delivery=delivery, message_id=message_id))
    return found


def quiet_outage(env: ChaosEnvironment, *, relays: Sequence[ManagedProcess], settle_s: float = 10.0) -> None:
    """Take the broker down. On Redis, first freeze the relays (SIGSTOP) and let the consumer queues
    empty: kombu's Redis transport pops a message before it records it as unacked, so a Redis server
    killed while a worker is between the two loses that message, a transport gap no inbox can see
    (docs/guarantees.md). The outbox keeps filling during the outage either way (the peak)."""
    frozen = []
    if env.kind == "redis":
        for proc in relays:
            pid = proc.pid if proc.alive() else None
            if pid is not None:
                os.kill(pid, signal.SIGSTOP)
                frozen.append(pid)
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and any(env.queue_depths().values()):
            time.sleep(0.1)
        time.sleep(0.2)  # the last popped message reaches its unacked record
    try:
        env.broker.outage_begin()
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def run_chaos(*, orders: int = 200, kills: int = 12, broker: str = "redis", seed: int = 0,
              workdir: Path | None = None, pg_admin_url: str = PG_ADMIN_URL, poison: int = 2,
              duplicates: int = 5, outage_s: float = 3.0, timeout_s: float = 180.0,
              relay: str = "standalone", takes: int | None = None, beat_kills: int | None = None,
              db_freeze_s: float = 3.0, consumers_stop_s: float = 0.0, orders_per_s: float | None = None,
              prefetch_multiplier: int | None = None, progress: Progress | None = None) -> ChaosReport:
    """Run the chaos scenario (see the module docstring) and return what was provoked and seen.

    ``relay``: ``standalone`` or ``beat`` (module docstring). ``takes``: take-window rounds, each losing
    one e-mail task and one event (default one per 100 orders, at least one). ``beat_kills``: SIGKILLs
    of beat in beat mode (default a quarter of ``kills``, at least two). ``db_freeze_s``: how long the
    processes' connections to Postgres stall, once, at two thirds of the order stream (0: never).
    ``consumers_stop_s``: how long the consumer workers are stopped (SIGSTOP, connections kept), once, from a
    fifth of the order stream, while orders keep coming (0: never). ``orders_per_s``: the order writer's
    rate (default: the stream lasts long enough for the kill plan). ``prefetch_multiplier``: the consumer
    workers' ``--prefetch-multiplier`` (None: the deployment's). On RabbitMQ a frozen worker's prefetch window
    keeps every message it can hold delivered to it, where the take window cannot reach them; a short run whose
    whole stream fits in those windows (the deployment prefetches 25 per process) finds nothing to lose
    unless the windows are small."""
    if relay not in RELAY_MODES:
        from celery_outbox.errors import ConfigError

        raise ConfigError(f"relay must be one of {', '.join(RELAY_MODES)}, got {relay!r}")
    say = progress or (lambda _msg: None)
    rng = random.Random(seed)
    # The take window and beat's deaths draw from their own generator: the rest of a seed's plan is
    # the same as before they existed.
    extra_rng = random.Random(f"take-window-and-beat:{seed}")
    started = time.monotonic()
    report = ChaosReport(broker=broker, seed=seed, orders=orders, kills_requested=kills, relay_mode=relay)
    rollback_idx = set(rng.sample(range(orders), max(1, orders // 10))) if orders > 1 else set()
    plan = [{"order_id": f"s{seed}-{i}", "rollback": i in rollback_idx} for i in range(orders)]
    rolled_back = [str(p["order_id"]) for p in plan if p["rollback"]]
    committed_target = orders - len(rolled_back)
    report.rolled_back = len(rolled_back)
    kill_plan = plan_kills(kills, rng)
    poison_consumers = [rng.choice(("shipping", "billing", "search")) for _ in range(poison)]
    longest = max((len(q) for q in kill_plan.values()), default=0)
    interval_ms = max(10, int(1000 * (4 + 2.5 * longest) / max(orders, 1)))
    if orders_per_s:
        interval_ms = max(1, int(1000 / orders_per_s))
    report.take_rounds = max(1, orders // 100) if takes is None else takes
    take_plan = deque(plan_takes(report.take_rounds, extra_rng))
    report.beat_kills_planned = 0 if relay != "beat" else (max(2, kills // 4) if beat_kills is None else beat_kills)
    beat_plan = deque((frac, extra_rng.uniform(0.2, 2.0))  # (when, how long beat stays dead)
                      for frac in plan_fractions(report.beat_kills_planned, extra_rng, lo=0.05, hi=0.95))
    base = workdir or Path(tempfile.mkdtemp(prefix="outbox-chaos-"))
    report.workdir = str(base)

    with ChaosEnvironment(broker=broker, workdir=base, db_proxy=db_freeze_s > 0,
                          prefetch_multiplier=prefetch_multiplier) as env:
        report.outage = env.broker.describe_outage()
        report.take_how = env.broker.describe_take()
        beat: ManagedProcess | None = None
        if relay == "beat":
            relay1, relay2, beat = env.relay_worker("relay"), env.relay_worker("relay-2"), env.beat("beat")
        else:
            relay1, relay2 = env.relay("relay"), env.relay("relay-2")
        roles: dict[str, ManagedProcess] = {
            "relay": relay1,
            "worker": env.worker("worker-1"),
            "orders": env.orders(plan, interval_ms=interval_ms),
        }
        helpers = {"worker-2": env.worker("worker-2")}
        workers = [roles["worker"], helpers["worker-2"]]
        say(f"database {env.db_name}, namespace {env.namespace}, broker {env.broker.url}, relay {relay}, "
            f"logs {base / 'logs'}")
        for name, proc in roles.items():
            proc.start(crash_points=kill_plan[name].popleft() if kill_plan[name] else "")
        for proc in helpers.values():
            proc.start()
        if beat is not None:
            beat.start()
        beat_back_at: float | None = None
        touched: set[str] = set()  # message ids re-published or duplicated: never lost too, and vice versa
        injected_poison = [env.poison(consumer=c) for c in poison_consumers]
        report.poison = len(injected_poison)
        say(f"injected {len(injected_poison)} poison message(s) into {', '.join(poison_consumers) or '-'}")

        orders_done = False
        outage_at: float | None = None
        outage_done = False
        dup_done = False
        relay2_started: float | None = None
        relay2_done = False
        kill_deadline: float | None = None
        freeze_at: float | None = None
        freeze_done = db_freeze_s <= 0
        stop_at: float | None = None
        stop_done = consumers_stop_s <= 0

        def committed() -> int:
            return env.count(Order)

        while True:
            # 1. reap and restart: a SIGKILL is a crash point reached; anything else but a clean
            #    exit of the order writer is a failure of the system under test.
            for name, proc in roles.items():
                if proc.proc is None or proc.alive():
                    continue
                armed = proc.armed
                code = proc.reap()
                if code == -9:
                    report.kills[armed.partition("@")[0]] += 1
                    say(f"{proc.name} SIGKILLed at {armed}")
                elif name == "orders" and code == 0:
                    orders_done = True
                    say("order writer finished its plan")
                    continue
                else:
                    report.unexpected_exits.append(f"{proc.name} exited {code} (armed {armed or '-'})")
                nxt = kill_plan[name].popleft() if kill_plan[name] else ""
                proc.start(crash_points=nxt)
            for proc in (*helpers.values(), relay2):
                if proc.proc is not None and not proc.alive():
                    report.unexpected_exits.append(f"{proc.name} exited {proc.reap()}")
                    proc.start()
            if beat is not None:
                if beat.proc is not None and not beat.alive():
                    report.unexpected_exits.append(f"{beat.name} exited {beat.reap()}")
                    beat.start()
                elif beat.proc is None and beat_back_at is not None and time.monotonic() >= beat_back_at:
                    beat.start()
                    beat_back_at = None

            # 2. sample the backlog (the "slow consumer" row's alert signals)
            outbox = env.tables.outbox
            with env.sessions() as s:
                snap_pending = env.pending()
                oldest = s.execute(sa.select(sa.func.min(outbox.created_at_ms)).where(
                    outbox.published_at_ms.is_(None),
                    outbox.dead_lettered_at_ms.is_(None))).scalar_one()
            report.peak_pending = max(report.peak_pending, snap_pending)
            if oldest is not None:
                report.peak_oldest_pending_age_ms = max(report.peak_oldest_pending_age_ms,
                                                        int(time.time() * 1000) - int(oldest))
            frac = committed() / max(committed_target, 1)

            # 3. scheduled provocations, at fractions of the order stream
            if relay2_started is None and frac >= 0.3:
                relay2.start()
                relay2_started = time.monotonic()
                say("second relay started (two relays at once)")
            if relay2_started is not None and not relay2_done and (frac >= 0.7 or orders_done):
                relay2.stop()
                report.second_relay_s = time.monotonic() - relay2_started
                relay2_done = True
                say(f"second relay stopped after {report.second_relay_s:.1f}s")
            if not dup_done and frac >= 0.4:
                lost_ids = {m.message_id for m in report.taken_and_lost}
                with env.sessions() as s:
                    published = [(seq, kind, str(mid)) for seq, kind, mid in s.execute(
                        sa.select(outbox.seq, outbox.type, outbox.message_id).where(
                            outbox.published_at_ms.is_not(None))).all()]
                published = [row for row in published if row[2] not in lost_ids]
                events = [seq for seq, kind, _ in published if kind == invariants.ORDER_PLACED]
                tasks = [seq for seq, kind, _ in published if kind == invariants.CONFIRMATION]
                if events:
                    # an OrderPlaced row re-published reaches every consumer; an e-mail task row, its one task
                    chosen_events = rng.sample(events, min(duplicates, len(events)))
                    chosen_tasks = rng.sample(tasks, min(duplicates, len(tasks)))
                    doubled = rng.choice(events)
                    picked = {*chosen_events, *chosen_tasks, doubled}
                    touched.update(mid for seq, _, mid in published if seq in picked)
                    repended = env.repend(chosen_events)
                    repended_tasks = env.repend(chosen_tasks)
                    extra = env.duplicate(doubled, copies=1)
                    report.duplicates_injected = repended * len(env.consumers) + repended_tasks + extra
                    dup_done = True
                    say(f"injected {report.duplicates_injected} duplicate deliveries ({repended} events and "
                        f"{repended_tasks} e-mail tasks re-published, 1 event sent twice at once)")
            broker_up = outage_at is None or outage_done
            db_frozen = freeze_at is not None and not freeze_done  # a round would wait out its TAKE_WAIT_S
            stopped = stop_at is not None and not stop_done  # a round would thaw the stopped consumers
            if take_plan and broker_up and not db_frozen and not stopped and (frac >= take_plan[0] or orders_done):
                deliveries = [invariants.EMAIL, extra_rng.choice(env.consumers)]
                lost = lose_in_take_window(env, workers=workers, deliveries=deliveries,
                                           exclude={*touched, *(m.message_id for m in report.taken_and_lost)})
                report.taken_and_lost.extend(lost)
                if len(lost) == len(deliveries) or orders_done:
                    take_plan.popleft()
                    if len(lost) < len(deliveries):
                        report.unexpected_exits.append(f"take window: found nothing to lose on "
                                                       f"{', '.join(sorted(set(deliveries) - {m.delivery for m in lost}))}")
                say(f"take window: lost {', '.join(f'{m.delivery} {m.message_id}' for m in lost) or 'nothing'} "
                    f"({report.take_how})")
            if beat is not None and beat_plan and beat.alive() and frac >= beat_plan[0][0]:
                _, down_s = beat_plan.popleft()
                beat.kill()
                report.beat_kills += 1
                beat_back_at = time.monotonic() + down_s
                say(f"beat SIGKILLed (back in {down_s:.1f}s)")
            if outage_at is None and frac >= 0.5:
                quiet_outage(env, relays=[p for p in (roles["relay"], relay2, beat) if p is not None])
                outage_at = time.monotonic()
                say(f"broker outage begins: {report.outage}")
            if outage_at is not None and not outage_done:
                report.outage_peak_pending = max(report.outage_peak_pending, snap_pending)
                if time.monotonic() - outage_at >= outage_s:
                    env.broker.outage_end()
                    report.outage_s = time.monotonic() - outage_at
                    outage_done = True
                    say(f"broker back after {report.outage_s:.1f}s")

            if not stop_done:
                if stop_at is None and (frac >= 0.2 or orders_done):
                    stop_at = time.monotonic()
                    say(f"consumers stopped for {consumers_stop_s:.0f}s while orders keep coming")
                if stop_at is not None and time.monotonic() - stop_at < consumers_stop_s:
                    for proc in workers:  # a worker restarted after a kill is stopped too
                        if proc.alive() and not proc.is_frozen:
                            proc.freeze()
                    if broker_up:  # (the outage may fall inside the stop: nothing to ask then)
                        with contextlib.suppress(Exception):
                            report.consumers_stop_peak_queued = max(report.consumers_stop_peak_queued,
                                                                    sum(env.queue_depths().values()))
                elif stop_at is not None:
                    for proc in workers:
                        proc.thaw()
                    report.consumers_stop_s = time.monotonic() - stop_at
                    stop_done = True
                    say(f"consumers resumed after {report.consumers_stop_s:.1f}s "
                        f"(up to {report.consumers_stop_peak_queued} messages queued)")

            if env.db_proxy is not None and not freeze_done:
                if freeze_at is None and outage_done and (frac >= 0.65 or orders_done):
                    env.db_proxy.freeze()
                    freeze_at = time.monotonic()
                    say(f"database frozen for {db_freeze_s:.1f}s (the processes' connections stall)")
                elif freeze_at is not None and time.monotonic() - freeze_at >= db_freeze_s:
                    env.db_proxy.thaw()
                    report.db_freeze_s = time.monotonic() - freeze_at
                    report.db_freeze_connections = env.db_proxy.frozen_connections
                    freeze_done = True
                    say(f"database thawed after {report.db_freeze_s:.1f}s, "
                        f"{report.db_freeze_connections} connection(s) stalled")

            # 4. done provoking? the stream is over and every kill fired (or had its chance)
            provoked = outage_done and freeze_done and stop_done and dup_done and relay2_done
            if orders_done and provoked and not take_plan and not beat_plan:
                if all(not q for q in kill_plan.values()) and all(not p.armed for p in roles.values()
                                                                   if p.name != "orders"):
                    break
                kill_deadline = kill_deadline or time.monotonic() + 15
                if time.monotonic() > kill_deadline:
                    break
            if time.monotonic() - started > timeout_s:
                report.unexpected_exits.append("the provocation phase ran out of time")
                break
            time.sleep(0.2)

        # Disarm whatever never reached its crash point, so the system can reach quiescence.
        for name, proc in roles.items():
            if name == "orders":
                continue
            if proc.armed:
                report.armed_not_reached.append(proc.armed)
                proc.stop()
                proc.start()
            report.armed_not_reached.extend(kill_plan[name])
        if roles["orders"].alive():
            roles["orders"].wait_exit(timeout_s=60)
        if beat is not None and not beat.alive():
            beat.reap()
            beat.start()
        if take_plan:
            report.unexpected_exits.append(f"take window: {len(take_plan)} round(s) found nothing to lose")
        if beat_plan:
            report.unexpected_exits.append(f"beat: {len(beat_plan)} planned SIGKILL(s) never happened")

        poison_set = list(injected_poison)
        min_dups = report.duplicates_injected

        def done() -> bool:
            with env.sessions() as s:
                return (invariants.quiescent(s, tables=env.tables, consumers=env.consumers,
                                             expected_dead_letters=len(poison_set))
                        and invariants.duplicates_absorbed(s, tables=env.tables) >= min_dups)

        say("waiting for quiescence")
        deadline = time.monotonic() + max(60.0, timeout_s - (time.monotonic() - started))
        while time.monotonic() < deadline and not done():
            for proc in (*roles.values(), *helpers.values(), *([beat] if beat is not None else [])):
                if proc.name != "orders" and proc.proc is not None and not proc.alive():
                    report.unexpected_exits.append(f"{proc.name} exited {proc.reap()} while settling")
                    proc.start()
            time.sleep(0.3)
        report.quiesced = done()
        time.sleep(1.0)  # let stragglers (a late duplicate) land before the final read
        with env.sessions() as s:
            report.invariants = invariants.check(s, tables=env.tables, consumers=env.consumers, rolled_back=rolled_back,
                                                 poison=poison_set, min_duplicates=min_dups,
                                                 now_ms=int(time.time() * 1000),
                                                 lost=[(m.inbox_consumer, m.message_id) for m in report.taken_and_lost])
            report.email_provider_calls = invariants.email_provider_calls(s)
        report.resent = resent_in_logs(base / "logs")
        late = report.resent_not_lost
        if late:  # docs/design.md, rule 16: a recovery mechanism acts on evidence of loss, never on age alone
            report.invariants.violations.append(invariants.Violation(
                invariant="re-sent only what was lost",
                detail=f"the reconciler re-sent {len(late)} message(s) the run never removed from the broker "
                       f"(late, not lost), e.g. {', '.join(f'{m.delivery} {m.message_id}' for m in late[:5])}"))
        report.matrix = build_matrix(report)
        report.figures = fault_figures(report)
        report.duration_s = time.monotonic() - started
        if not report.ok:
            say(env.logs())
    return report


def build_matrix(r: ChaosReport) -> list[MatrixRow]:
    """The failure matrix (docs/failure-matrix.md) with this run's counts and what the invariants saw."""
    assert r.invariants is not None
    v = r.invariants.violations
    snap = r.invariants.snapshot
    k = r.kills
    effects_bad = violated(v, "effect", "seen once")
    rows: list[MatrixRow] = []

    def add(failure: str, provoked: str, times: int, text: str, problems: list[invariants.Violation]) -> None:
        observed, ok = verdict(True, text, problems)
        rows.append(MatrixRow(failure=failure, provoked=provoked, times=times, observed=observed, ok=ok))

    add("order commit fails", "transaction fails after its INSERTs (after_flush raises)", r.rolled_back,
        f"{r.rolled_back} rolled-back order(s): no order, no outbox row, no effect",
        violated(v, "rolled-back", "without a committed order", "no event without"))
    before_publish = k["after_order_commit"] + k["after_claim_before_publish"]
    add("crash after commit, before publish",
        f"SIGKILL order writer at after_order_commit ({k['after_order_commit']}), "
        f"relay at after_claim_before_publish ({k['after_claim_before_publish']})", before_publish,
        f"{snap.committed_orders} committed orders all published; {snap.pending} pending",
        violated(v, "relay drained", "has its outbox row") + effects_bad)
    add("broker down (peak hour)", r.outage, 1 if r.outage_s else 0,
        f"down {r.outage_s:.1f}s, backlog peaked at {r.outage_peak_pending} pending; drained by itself; "
        f"{snap.relay_dead_letters} relay dead letter(s)",
        violated(v, "relay dead-letters", "relay drained"))
    add("crash after publish, before mark",
        f"SIGKILL relay at after_publish_before_mark ({k['after_publish_before_mark']}), "
        f"after_mark ({k['after_mark']})", k["after_publish_before_mark"] + k["after_mark"],
        "re-published; the inbox dropped the duplicates; one effect per order and consumer", effects_bad)
    add("consumer dies before its commit",
        f"SIGKILL worker at consumer_before_commit ({k['consumer_before_commit']}), "
        f"consumer_after_commit_before_ack ({k['consumer_after_commit_before_ack']})",
        k["consumer_before_commit"] + k["consumer_after_commit_before_ack"],
        "redelivered and processed once; no partial effect", effects_bad)
    add("same message twice, even in parallel",
        "rows re-published + one event sent twice at once to every consumer; 2 workers", r.duplicates_injected,
        f"{snap.duplicates_absorbed} duplicate deliveries absorbed (>= {r.duplicates_injected} injected)",
        violated(v, "duplicates") + effects_bad)
    add("poison message", "malformed OrderPlaced payload put straight on a consumer queue", r.poison,
        f"{snap.dead_letters} dead letter(s), exactly the poison; the messages behind it flowed",
        violated(v, "dead letters"))
    if r.db_freeze_s:
        add("database freezes (a stalled server, connections kept)",
            "loopback proxy between every process and Postgres stops forwarding, then resumes",
            1, f"{r.db_freeze_connections} connection(s) stalled {r.db_freeze_s:.1f}s; the processes resumed, "
               f"{snap.pending} pending at the end; one effect per order",
            violated(v, "relay drained") + effects_bad)
    add("two relays at once", "second `outbox relay` process alongside the first", 1 if r.second_relay_s else 0,
        f"ran {r.second_relay_s:.1f}s together; SKIP LOCKED + inbox: one effect per order", effects_bad)
    add("slow consumer, fast relay", "backlog sampled every 0.2s during the run", 1,
        f"peak {r.peak_pending} pending rows, oldest pending age peaked at {r.peak_oldest_pending_age_ms} ms "
        "(the alert signals)", [])
    lost_kinds = Counter("e-mail task" if m.delivery == invariants.EMAIL else "event" for m in r.taken_and_lost)
    add("worker killed between taking a message and recording it",
        f"{r.take_how} ({lost_kinds['e-mail task']} e-mail task(s), {lost_kinds['event']} event(s), "
        f"rows marked published)", len(r.taken_and_lost),
        f"all {len(r.taken_and_lost)} recorded once after all; the reconciler re-sent {snap.reconciled} message(s) "
        f"({snap.reconciled_tasks} e-mail task(s), {snap.reconciled_events} event deliveries)",
        violated(v, "taken and lost") + (
            [] if r.taken_and_lost else [invariants.Violation(invariant="taken and lost",
                                                              detail="nothing was lost: not provoked")]))
    behind = [f"a {r.db_freeze_s:.0f} s database freeze"] if r.db_freeze_s else []
    behind += [f"a {r.outage_s:.0f} s broker outage"] if r.outage_s else []
    behind += [f"consumers stopped {r.consumers_stop_s:.0f} s"] if r.consumers_stop_s else []
    add("consumers behind (freeze, outage, stopped consumers)", ", ".join(behind) or "-", len(behind),
        f"the reconciler re-sent {len(r.resent)} message(s), {len(r.resent_not_lost)} of them late, not lost; "
        f"{r.email_provider_calls} e-mail provider call(s) for {snap.effects.get(invariants.EMAIL, 0)} e-mail(s)",
        violated(v, "re-sent only what was lost"))
    if r.relay_mode == "beat":
        add("beat killed (the relay driven by beat)",
            "SIGKILL `celery beat` at random moments, restarted 0.2-2 s later; relay-queue workers run its "
            "drain and reconcile tasks", r.beat_kills,
            f"{r.beat_kills} beat death(s); the drains resumed, {snap.pending} pending at the end",
            violated(v, "relay drained") + effects_bad)
    add("the confirmation e-mail (an `@outbox.task`) through all of the above",
        "enqueued with each order in its transaction; every provocation above hits its path too",
        snap.committed_orders,
        f"{snap.effects.get(invariants.EMAIL, 0)} e-mail(s) for {snap.committed_orders} committed order(s), none "
        f"for the {r.rolled_back} rolled back",
        violated(v, f"{invariants.EMAIL}:", "e-mail task"))
    return rows
