"""Commit -> effect latency with and without PgBouncer in transaction pooling, in the same run.

One Postgres database, one Redis of its own, one PgBouncer (tests/production/pgbouncer.py, the
configuration docs/deployment.md shows), the deployment's DEFAULT settings. Rounds of three modes,
interleaved (mode A, B, C, A, B, C, ...), each round with the relay and two ``celery worker`` processes
(solo pool) started for it on that mode's URLs:

- ``direct``: every process, and this script's order writer, on the direct URL;
- ``pooled``: every process and the writer through PgBouncer, the relay's LISTEN on a direct
  ``OUTBOX_RELAY_LISTEN_URL`` (the recommended configuration);
- ``pooled_polling``: through PgBouncer with no listen URL: the relay's probe NOTIFY goes unheard and
  it polls every ``OUTBOX_RELAY_POLL_INTERVAL_S`` (1 s by default).

Each round places ``--orders`` orders at ``--rate`` per second (``place_order``: the order, its
OrderPlaced row and the confirmation e-mail task's row, one commit) and waits until all four deliveries
of each (three consumers and the e-mail task) are recorded. Latency per delivery, from the database
alone: the inbox row's ``processed_at_ms`` (the effect's commit) minus the outbox row's
``created_at_ms`` (stamped in the order's transaction, just before its commit). With ``--kill``, the
relay and one worker are SIGKILLed (and started again) halfway through each round. At the end every
chaos invariant is checked over all rounds (chaos/invariants.py): lost and doubled effects are counted.
Writes bench/results/<--name, pooler_latency>.json.

    flock /tmp/heavy.lock .venv/bin/python bench/pooler_latency.py [--orders 200] [--rate 20] [--rounds 3]
        [--kill] [--name pooler_latency]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

from bench._common import percentile, write_result
from celery_outbox.db import make_engine, make_session_factory
from celeryconfig import Settings
from chaos import invariants
from chaos.environment import CHAOS_ENV, ChaosEnvironment
from chaos.load import order_body
from chaos.processes import ManagedProcess
from orders.service import parse_order, place_order
from relay.factory import create_outbox
from tests.production.pgbouncer import PgBouncer, find_pgbouncer

MODES = ("direct", "pooled", "pooled_polling")


def default_env() -> dict[str, str]:
    """The chaos environment's fast-failure knobs put back to the deployment's defaults: a product run."""
    defaults = {f.name: f.default for f in fields(Settings)}
    return {key: str(defaults[key.removeprefix("OUTBOX_").lower()]) for key in CHAOS_ENV}


# With --kill: a SIGKILLed worker's unacked Redis message comes back after the visibility timeout, and one
# lost between kombu's BRPOP and its unacked record is re-sent by the reconciler: the chaos run's short
# values, so a round ends within a minute instead of the defaults' hour.
KILL_ENV = ("OUTBOX_BROKER_VISIBILITY_TIMEOUT_S", "OUTBOX_CONSUMER_TIME_LIMIT_S", "OUTBOX_CONSUMER_RETRY_BACKOFF_S",
            "OUTBOX_CONSUMER_RETRY_BACKOFF_MAX_S", "OUTBOX_RELAY_RECONCILE_AFTER_MS",
            "OUTBOX_RELAY_RECONCILE_INTERVAL_S")


def configure(env: ChaosEnvironment, bouncer: PgBouncer, mode: str) -> None:
    env.process_database_url = env.database_url if mode == "direct" else bouncer.url(env.database_url)
    env.extra_env.pop("OUTBOX_RELAY_LISTEN_URL", None)
    if mode == "pooled":
        env.extra_env["OUTBOX_RELAY_LISTEN_URL"] = env.database_url


def ready(proc: ManagedProcess, words: tuple[str, ...]) -> bool:
    text = proc.log_path.read_text(errors="replace").rsplit("=== ", 1)[-1] if proc.log_path.exists() else ""
    return any(w in text for w in words)


def place(env: ChaosEnvironment, *, tag: str, orders: int, rate: float, halfway: Any) -> None:
    """``orders`` orders at ``rate``/s on the mode's URL; ``halfway()`` is called once in the middle."""
    engine = make_engine(env.process_database_url, settings=env.settings)
    sessions = make_session_factory(engine)
    outbox = create_outbox(env.settings, session_factory=sessions)
    start = time.perf_counter()
    try:
        for i in range(orders):
            if i == orders // 2:
                halfway()
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            with sessions() as s:
                place_order(s, parse_order(order_body(f"{tag}-{i}", index=i)), outbox=outbox)
    finally:
        engine.dispose()


def latencies(env: ChaosEnvironment, *, since_ms: int, expected: int, timeout_s: float = 180) -> list[float]:
    """processed_at_ms - created_at_ms of every delivery of the rows created since ``since_ms``, once all
    ``expected`` are recorded."""
    outbox, inbox = env.tables.outbox, env.tables.inbox
    query = (sa.select(inbox.processed_at_ms - outbox.created_at_ms)
             .join(outbox, outbox.message_id == inbox.message_id).where(outbox.created_at_ms >= since_ms))
    deadline = time.monotonic() + timeout_s
    while True:
        with env.sessions() as s:
            rows = [float(v) for v in s.execute(query).scalars()]
        if len(rows) >= expected:
            return rows
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(rows)}/{expected} deliveries after {timeout_s:.0f}s\n{env.logs()}")
        time.sleep(0.3)


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": round(percentile(values, 50), 1), "p99_ms": round(percentile(values, 99), 1),
            "max_ms": round(max(values), 1) if values else float("nan")}


def run(*, orders: int, rate: float, rounds: int, kill: bool) -> dict[str, Any]:
    exe = find_pgbouncer()
    if exe is None:
        raise SystemExit("pgbouncer is not installed (Debian package pgbouncer)")
    per_mode: dict[str, list[list[float]]] = defaultdict(list)
    kills: dict[str, int] = defaultdict(int)
    with tempfile.TemporaryDirectory(prefix="pooler-latency-") as tmp, PgBouncer(executable=exe) as bouncer, \
            ChaosEnvironment(broker="redis", workdir=Path(tmp),
                             extra_env={**default_env(), **({k: CHAOS_ENV[k] for k in KILL_ENV} if kill else {})}) as env:
        deliveries = len(env.consumers) + 1  # the consumers and the e-mail task
        for r in range(rounds):
            for mode in MODES:
                configure(env, bouncer, mode)
                relay = env.relay(f"relay-{mode}-{r}")
                workers = [env.worker(f"worker{i}-{mode}-{r}") for i in range(2)]
                for p in (relay, *workers):
                    p.start()
                env.wait(lambda relay=relay: ready(relay, ("listening on", "heard no NOTIFY")),  # type: ignore[misc]
                         timeout_s=60, what=f"{mode}: the relay ready")
                for w in workers:
                    env.wait(lambda w=w: ready(w, ("ready.",)), timeout_s=60,  # type: ignore[misc]
                             what=f"{mode}: {w.name} ready")

                def halfway(relay: ManagedProcess = relay, worker: ManagedProcess = workers[0], mode: str = mode) -> None:
                    if kill:
                        for p in (relay, worker):
                            p.kill()
                            p.start()
                            kills[mode] += 1

                since = int(time.time() * 1000)
                place(env, tag=f"{mode}-{r}", orders=orders, rate=rate, halfway=halfway)
                values = latencies(env, since_ms=since, expected=orders * deliveries)
                per_mode[mode].append(values)
                print(f"round {r} {mode}: {summary(values)}", flush=True)
                for p in (relay, *workers):
                    p.stop()
        with env.sessions() as s:
            report = invariants.check(s, tables=env.tables, consumers=env.consumers, rolled_back=[], poison=[])
    snap = report.snapshot
    # The first round of each mode warms up (imports, pools, the broker's queues) and is left out when there are more.
    kept = {m: [v for rnd in (rs[1:] if len(rs) > 1 else rs) for v in rnd] for m, rs in per_mode.items()}
    return {
        "orders_per_round": orders, "rate_per_s": rate, "rounds": rounds, "kill": kill,
        "modes": {m: {**summary(kept[m]), "rounds": [summary(v) for v in per_mode[m]], "sigkills": kills[m]}
                  for m in MODES},
        "committed_orders": snap.committed_orders, "lost": snap.missing_effects, "doubled": snap.extra_effects,
        "invariants_ok": report.ok, "violations": [v.detail for v in report.violations][:10],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kill", action="store_true")
    parser.add_argument("--name", default="pooler_latency")
    args = parser.parse_args()
    data = run(orders=args.orders, rate=args.rate, rounds=args.rounds, kill=args.kill)
    for mode, figures in data["modes"].items():
        print(f"{mode:15s} p50 {figures['p50_ms']:8.1f} ms  p99 {figures['p99_ms']:8.1f} ms  (n={figures['n']})")
    print(f"committed {data['committed_orders']}, lost {data['lost']}, doubled {data['doubled']}, "
          f"invariants {'ok' if data['invariants_ok'] else data['violations']}")
    write_result(args.name, data)


if __name__ == "__main__":
    main()
