"""``run_chaos``: the whole failure matrix in one run, with real processes and real SIGKILLs.

Against a Postgres database of its own and a real broker it runs the order writer, a relay and two
workers as subprocesses; arms them with crash points from a seeded kill plan and, each time one dies
by SIGKILL, restarts it armed with the next; takes the broker away once mid-run and brings it back;
runs a second relay for a while; injects poison messages and duplicate deliveries; waits for
quiescence; and checks chaos/invariants.py. The same seed gives the same plan (which orders fail,
which crash points in which order, which consumers get poison); process timing is real, so what
each kill hits varies, and the invariants must hold whatever it hits.
"""

from __future__ import annotations

import contextlib
import os
import random
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
from chaos.matrix import MatrixRow, verdict, violated
from chaos.processes import ManagedProcess
from orders.models import Order

ROLE_POINTS: dict[str, tuple[str, ...]] = {
    "relay": ("after_claim_before_publish", "after_publish_before_mark", "after_mark"),
    "worker": ("consumer_before_commit", "consumer_after_commit_before_ack"),
    "orders": ("after_order_commit",),
}

Progress = Callable[[str], None]


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
              progress: Progress | None = None) -> ChaosReport:
    """Run the chaos scenario (see the module docstring) and return what was provoked and seen."""
    say = progress or (lambda _msg: None)
    rng = random.Random(seed)
    started = time.monotonic()
    report = ChaosReport(broker=broker, seed=seed, orders=orders, kills_requested=kills)
    rollback_idx = set(rng.sample(range(orders), max(1, orders // 10))) if orders > 1 else set()
    plan = [{"order_id": f"s{seed}-{i}", "rollback": i in rollback_idx} for i in range(orders)]
    rolled_back = [str(p["order_id"]) for p in plan if p["rollback"]]
    committed_target = orders - len(rolled_back)
    report.rolled_back = len(rolled_back)
    kill_plan = plan_kills(kills, rng)
    poison_consumers = [rng.choice(("shipping", "billing", "search")) for _ in range(poison)]
    longest = max((len(q) for q in kill_plan.values()), default=0)
    interval_ms = max(10, int(1000 * (4 + 2.5 * longest) / max(orders, 1)))
    base = workdir or Path(tempfile.mkdtemp(prefix="outbox-chaos-"))
    report.workdir = str(base)

    with ChaosEnvironment(broker=broker, workdir=base) as env:
        report.outage = env.broker.describe_outage()
        roles: dict[str, ManagedProcess] = {
            "relay": env.relay("relay"),
            "worker": env.worker("worker-1"),
            "orders": env.orders(plan, interval_ms=interval_ms),
        }
        helpers = {"worker-2": env.worker("worker-2")}
        relay2 = env.relay("relay-2")
        say(f"database {env.db_name}, namespace {env.namespace}, broker {env.broker.url}, logs {base / 'logs'}")
        for name, proc in roles.items():
            proc.start(crash_points=kill_plan[name].popleft() if kill_plan[name] else "")
        for proc in helpers.values():
            proc.start()
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
                with env.sessions() as s:
                    published = s.execute(sa.select(outbox.seq, outbox.type).where(
                        outbox.published_at_ms.is_not(None))).all()
                events = [seq for seq, kind in published if kind == invariants.ORDER_PLACED]
                tasks = [seq for seq, kind in published if kind == invariants.CONFIRMATION]
                if events:
                    # an OrderPlaced row re-published reaches every consumer; an e-mail task row, its one task
                    repended = env.repend(rng.sample(events, min(duplicates, len(events))))
                    repended_tasks = env.repend(rng.sample(tasks, min(duplicates, len(tasks))))
                    extra = env.duplicate(rng.choice(events), copies=1)
                    report.duplicates_injected = repended * len(env.consumers) + repended_tasks + extra
                    dup_done = True
                    say(f"injected {report.duplicates_injected} duplicate deliveries ({repended} events and "
                        f"{repended_tasks} e-mail tasks re-published, 1 event sent twice at once)")
            if outage_at is None and frac >= 0.5:
                quiet_outage(env, relays=[roles["relay"], relay2])
                outage_at = time.monotonic()
                say(f"broker outage begins: {report.outage}")
            if outage_at is not None and not outage_done:
                report.outage_peak_pending = max(report.outage_peak_pending, snap_pending)
                if time.monotonic() - outage_at >= outage_s:
                    env.broker.outage_end()
                    report.outage_s = time.monotonic() - outage_at
                    outage_done = True
                    say(f"broker back after {report.outage_s:.1f}s")

            # 4. done provoking? the stream is over and every kill fired (or had its chance)
            if orders_done and outage_done and dup_done and relay2_done:
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
            for proc in (*roles.values(), *helpers.values()):
                if proc.name != "orders" and proc.proc is not None and not proc.alive():
                    report.unexpected_exits.append(f"{proc.name} exited {proc.reap()} while settling")
                    proc.start()
            time.sleep(0.3)
        report.quiesced = done()
        time.sleep(1.0)  # let stragglers (a late duplicate) land before the final read
        with env.sessions() as s:
            report.invariants = invariants.check(s, tables=env.tables, consumers=env.consumers, rolled_back=rolled_back,
                                                 poison=poison_set, min_duplicates=min_dups,
                                                 now_ms=int(time.time() * 1000))
        report.matrix = build_matrix(report)
        report.duration_s = time.monotonic() - started
        if not report.ok:
            say(env.logs())
    return report


def build_matrix(r: ChaosReport) -> list[MatrixRow]:
    """DESIGN.md's failure matrix with this run's counts and what the invariants saw."""
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
    add("two relays at once", "second `outbox relay` process alongside the first", 1 if r.second_relay_s else 0,
        f"ran {r.second_relay_s:.1f}s together; SKIP LOCKED + inbox: one effect per order", effects_bad)
    add("slow consumer, fast relay", "backlog sampled every 0.2s during the run", 1,
        f"peak {r.peak_pending} pending rows, oldest pending age peaked at {r.peak_oldest_pending_age_ms} ms "
        "(the alert signals)", [])
    return rows
