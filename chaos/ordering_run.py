"""Per-entity ordering under several relays: versions of each order through N ``outbox relay``
processes and real ``celery worker`` processes to the search effect as an ``ordering=True`` consumer.

Real processes, as in a chaos run (chaos/environment.py): N ``outbox relay`` processes on one outbox
(each claims with ``FOR UPDATE SKIP LOCKED``, so successive versions of one order can be published by
different relays and reach the queue in either order) and ``celery worker`` processes consuming the
search queue (``OUTBOX_ROUTES=OrderPlaced=search``: the reference deployment's search effect declared as a
per-entity ordered consumer, ``consumers.search.search_in_order`` in ``chaos/ordered_search_app.py``, which
upserts the order's document with the event's version; the deployment itself runs it as a batch consumer). The relays and
consumers run the library's default settings (not the chaos run's fast failure settings).

The writer commits one event per transaction: version 1 of an order (``OrderPlaced``, entity
``order:<id>``), then versions 2..N of the same order (the same event type with a changed total: the
deployment has no update event, and its search consumer applies any version), interleaved over a
window of orders picked at random, so successive versions of an order are a few commits apart.

What is counted, from the database (triggers added for the run, the library untouched):

- **applied out of order**: every insert or update of a search document is logged with the version it
  replaced; an applied version that is not the previous one + 1 (an older one overwriting a newer one,
  or a gap) is out of order. Must be 0.
- **stale skipped**: search inbox rows (each version recorded once) minus the versions applied;
- **parked, released**: inserts into the parked table that committed, and their deletes (a parked
  version applied after its predecessor, in the predecessor's transaction); the park latency is from
  the insert to the delete (the database's clock);
- **published before their predecessor**: versions whose outbox row's ``published_at_ms`` is earlier
  than the previous version's (what several relays do to publication order);
- duplicates absorbed, dead letters (parked messages that timed out land there: must be 0).

Used by bench/relays_ordering.py (figures in docs/scaling.md) and tests/integration/test_relays_ordering.py.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from celery_outbox import Event, counters
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings as LibrarySettings
from chaos.environment import CHAOS_ENV, REPO, ChaosEnvironment
from chaos.processes import ManagedProcess, worker_argv
from relay.factory import create_outbox

Progress = Callable[[str], None]
CONSUMER = "search"
ORDERED_APP = "chaos.ordered_search_app"  # the search effect as an ordered consumer (consumers/search.py)

# The library's defaults for every knob the chaos environment speeds up: this run measures the
# deployment as configured, not a failure drill.
DEFAULT_ENV: dict[str, str] = {
    key: str(LibrarySettings.__dataclass_fields__[key.removeprefix("OUTBOX_").lower()].default)
    for key in CHAOS_ENV
}

AUDIT_SQL = """
CREATE TABLE bench_applied (
    id bigserial PRIMARY KEY, order_id text NOT NULL, old_version bigint, new_version bigint NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION bench_applied_log() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' THEN
        INSERT INTO bench_applied (order_id, old_version, new_version) VALUES (NEW.order_id, OLD.version, NEW.version);
    ELSE
        INSERT INTO bench_applied (order_id, old_version, new_version) VALUES (NEW.order_id, NULL, NEW.version);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER bench_applied_log AFTER INSERT OR UPDATE ON search_documents
    FOR EACH ROW EXECUTE FUNCTION bench_applied_log();
CREATE TABLE bench_parked (
    id bigserial PRIMARY KEY, message_id uuid NOT NULL, entity_key text, entity_version bigint, op text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION bench_parked_log() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO bench_parked (message_id, entity_key, entity_version, op)
        VALUES (NEW.message_id, NEW.entity_key, NEW.entity_version, 'park');
    ELSE
        INSERT INTO bench_parked (message_id, entity_key, entity_version, op)
        VALUES (OLD.message_id, OLD.entity_key, OLD.entity_version, 'release');
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER bench_parked_log AFTER INSERT OR DELETE ON {parked}
    FOR EACH ROW EXECUTE FUNCTION bench_parked_log();
"""


@dataclass(kw_only=True)
class OrderingReport:
    relays: int
    orders: int
    versions: int  # per order
    workers: int
    concurrency: int
    written: int = 0  # events committed (orders x versions)
    applied: int = 0  # versions applied to the search documents
    applied_out_of_order: int = 0  # must be 0
    out_of_order_examples: list[str] = field(default_factory=list)
    orders_incomplete: int = 0  # orders whose document did not reach version N: must be 0
    stale_skipped: int = 0
    parked: int = 0
    released: int = 0
    still_parked: int = 0
    park_ms_p50: float | None = None
    park_ms_p99: float | None = None
    park_ms_max: float | None = None
    published_before_predecessor: int = 0
    duplicates_absorbed: int = 0
    dead_letters: int = 0
    quiesced: bool = False
    write_s: float = 0.0
    drain_s: float = 0.0  # from the last commit to every version recorded
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.quiesced and not self.violations and self.applied_out_of_order == 0

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def writer_plan(orders: int, versions: int, *, window: int, seed: int) -> list[tuple[str, int]]:
    """(order id, version) in commit order: versions 1..N of each order, in order per order, interleaved
    over ``window`` open orders picked at random."""
    rng = random.Random(seed)
    tag = uuid.uuid4().hex[:6]
    ids = [f"ro-{tag}-{i}" for i in range(orders)]
    nxt = iter(ids)
    open_: dict[str, int] = {}
    plan: list[tuple[str, int]] = []
    while True:
        while len(open_) < window:
            oid = next(nxt, None)
            if oid is None:
                break
            open_[oid] = 0
        if not open_:
            return plan
        oid = rng.choice(sorted(open_))
        open_[oid] += 1
        plan.append((oid, open_[oid]))
        if open_[oid] == versions:
            del open_[oid]


def _payload(order_id: str, version: int) -> dict[str, Any]:
    qty = version  # each version changes the order (its quantity and total)
    return {"order_id": order_id, "customer_id": "c-1", "email": "buyer@example.com", "currency": "EUR",
            "total_cents": qty * 1250, "lines": [{"sku": "sku-1", "quantity": qty, "unit_price_cents": 1250}]}


def _write(env: ChaosEnvironment, plan: list[tuple[str, int]], rate: float, done: list[float]) -> None:
    outbox = create_outbox(env.settings, session_factory=env.sessions)
    start = time.monotonic()
    for i, (oid, version) in enumerate(plan):
        with env.sessions() as s:
            outbox.publish(s, Event("OrderPlaced", _payload(oid, version), entity_key=f"order:{oid}",
                                    entity_version=version))
            s.commit()
        lag = start + (i + 1) / rate - time.monotonic()
        if lag > 0:
            time.sleep(lag)
    done.append(time.monotonic() - start)


def _percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))], 1)


def run_ordering(*, relays: int, orders: int, versions: int, workdir: Path, tables: Tables | None = None,
                 workers: int = 2, concurrency: int = 4, pool: str = "threads", rate: float = 100.0,
                 window: int = 20, seed: int = 1, timeout_s: float = 300.0, worker_app: str = ORDERED_APP,
                 worker_env: Mapping[str, str] | None = None, progress: Progress | None = None) -> OrderingReport:
    """See the module docstring: ``orders`` x ``versions`` events at ``rate`` commits/s through
    ``relays`` relay processes and ``workers`` worker processes of ``concurrency`` each. ``worker_app``
    and ``worker_env``: another Celery app for the workers (a check that the run can see disorder)."""
    say = progress or (lambda _m: None)
    report = OrderingReport(relays=relays, orders=orders, versions=versions, workers=workers, concurrency=concurrency)
    plan = writer_plan(orders, versions, window=window, seed=seed)
    env = ChaosEnvironment(broker="rabbitmq", workdir=workdir, tables=tables,
                           extra_env={**DEFAULT_ENV, "OUTBOX_ROUTES": f"OrderPlaced={CONSUMER}"})
    with env:
        tabs = env.tables
        with env.sessions() as s:
            s.connection().exec_driver_sql(AUDIT_SQL.format(parked=tabs.table(tabs.parked).name))
            s.commit()
        procs = [env.relay(f"relay-{i + 1}") for i in range(relays)]
        queue = env.settings.queue_name(CONSUMER)
        procs += [env.processes.add(ManagedProcess(
            name=f"worker-{i + 1}", env=env.env, log_dir=workdir / "logs", cwd=REPO,
            argv=worker_argv(queues=[queue], pool=pool, concurrency=concurrency, app=worker_app,
                             hostname=f"worker-{i + 1}-{env.namespace}"))) for i in range(workers)]
        for p in procs:
            p.start(extra_env=worker_env if p.name.startswith("worker") else None)
        say(f"database {env.db_name}, namespace {env.namespace}, {relays} relays, {workers} workers x {concurrency}, "
            f"logs {workdir / 'logs'}")
        env.wait(lambda: _consumers_on(env, queue) >= workers, timeout_s=120, what="the workers consuming")
        time.sleep(2.0)  # the relays' LISTEN is up (they start faster than the workers)
        done: list[float] = []
        writer = threading.Thread(target=_write, args=(env, plan, rate, done), daemon=True)
        writer.start()
        writer.join(timeout=timeout_s)
        if not done:
            report.violations.append("the writer did not finish in time")
            return report
        report.write_s = round(done[0], 2)
        last = time.monotonic()
        inbox = tabs.inbox

        def recorded() -> int:
            return env.count(inbox, inbox.consumer == CONSUMER)

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (recorded() < len(plan) or env.pending() or _parked_now(env, tabs)):
            time.sleep(0.3)
        report.drain_s = round(time.monotonic() - last, 2)
        report.quiesced = recorded() >= len(plan) and env.pending() == 0 and _parked_now(env, tabs) == 0
        time.sleep(1.0)  # a late duplicate lands before the final read
        for p in procs:
            if not p.alive():
                report.violations.append(f"{p.name} exited {p.returncode()} during the run")
        _count(env, tabs, report, expected=len(plan))
        if not report.ok:
            say(env.logs())
    return report


def _consumers_on(env: ChaosEnvironment, queue: str) -> int:
    from kombu import Connection, Queue

    try:
        with Connection(env.broker.url, connect_timeout=5) as conn:
            _, _, consumers = Queue(queue, channel=conn.channel()).queue_declare(passive=True)
    except Exception:  # not declared yet (404 closes the channel): nobody consumes it
        return 0
    return int(consumers)


def _parked_now(env: ChaosEnvironment, tabs: Tables) -> int:
    return env.count(tabs.parked, tabs.parked.consumer == CONSUMER)


def _count(env: ChaosEnvironment, tabs: Tables, report: OrderingReport, *, expected: int) -> None:
    with env.sessions() as s:
        q = s.connection().exec_driver_sql
        report.written = int(q("SELECT count(*) FROM " + tabs.table(tabs.outbox).name).scalar_one())
        report.applied = int(q("SELECT count(*) FROM bench_applied").scalar_one())
        bad = q("SELECT order_id, old_version, new_version FROM bench_applied "
                "WHERE new_version <> coalesce(old_version, 0) + 1 ORDER BY id").all()
        report.applied_out_of_order = len(bad)
        report.out_of_order_examples = [f"{o}: {old} -> {new}" for o, old, new in bad[:10]]
        report.orders_incomplete = int(q(
            "SELECT count(*) FROM (SELECT order_id FROM bench_applied GROUP BY order_id "
            "HAVING max(new_version) <> %(n)s OR count(*) <> %(n)s) x", {"n": report.versions}).scalar_one())
        report.orders_incomplete += report.orders - int(q(
            "SELECT count(DISTINCT order_id) FROM bench_applied").scalar_one())
        inbox_rows = env.count(tabs.inbox, tabs.inbox.consumer == CONSUMER)
        report.stale_skipped = inbox_rows - report.applied
        report.parked = int(q("SELECT count(*) FROM bench_parked WHERE op = 'park'").scalar_one())
        report.released = int(q("SELECT count(*) FROM bench_parked WHERE op = 'release'").scalar_one())
        report.still_parked = _parked_now(env, tabs)
        waits = [float(ms) for (ms,) in q(
            "SELECT extract(epoch FROM r.at - p.at) * 1000 FROM bench_parked p JOIN bench_parked r "
            "ON r.message_id = p.message_id AND r.op = 'release' WHERE p.op = 'park'").all()]
        report.park_ms_p50 = _percentile(waits, 50)
        report.park_ms_p99 = _percentile(waits, 99)
        report.park_ms_max = round(max(waits), 1) if waits else None
        outbox = tabs.table(tabs.outbox).name
        report.published_before_predecessor = int(q(
            f"SELECT count(*) FROM {outbox} a JOIN {outbox} b ON a.headers->>'entity_key' = b.headers->>'entity_key' "
            "AND (a.headers->>'entity_version')::int = (b.headers->>'entity_version')::int + 1 "
            "WHERE a.published_at_ms < b.published_at_ms").scalar_one())
        report.duplicates_absorbed = counters.value(s, CONSUMER, "duplicates", tables=tabs)
        report.dead_letters = env.count(tabs.dead_letters)
    if report.written != expected:
        report.violations.append(f"{report.written} events written, {expected} planned")
    if report.applied_out_of_order:
        report.violations.append(f"{report.applied_out_of_order} versions applied out of order: "
                                 f"{report.out_of_order_examples}")
    if report.orders_incomplete:
        report.violations.append(f"{report.orders_incomplete} orders did not reach version {report.versions} "
                                 "exactly once per version")
    if report.dead_letters:
        report.violations.append(f"{report.dead_letters} dead letters")
    if report.still_parked or report.released != report.parked:
        report.violations.append(f"parked {report.parked}, released {report.released}, "
                                 f"still parked {report.still_parked}")
