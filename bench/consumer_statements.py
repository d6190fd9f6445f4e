"""Database round trips per delivery: what a consumer's pool process sends Postgres, counted by kind.

Runs ``delivery.deliver_with`` (what the consumer task runs in a pool process, with the consumer's
``DeliveryContext`` built once as the task builds it) on N fresh first deliveries and N duplicates, each
body already JSON text as the task receives it; and, for comparison, the plain task of
bench/_plain_worker.py (the JSON body made an ``Envelope``, the effect and its commit, no inbox) and that
plain task with the inbox claim added to its transaction (``plain_with_claim``: what the guarantee adds at
the least, so ``outbox_first_delivery`` minus it is what the library's delivery costs beyond the claim);
against a throwaway Postgres database, on an engine built like the worker's (``db.make_engine``).

Counts, per delivery: statements the driver executed (``before_cursor_execute``), pool pre-pings (the
dialect's ``do_ping``), commits and rollbacks, pool checkouts; and the CPU each costs in microseconds:
``cpu_us`` in this process (``time.process_time``: Python, SQLAlchemy, the driver), and ``pg_cpu_us`` in
the Postgres backends it used (utime + stime of their ``/proc/<pid>/stat``, 10 ms ticks: run enough
deliveries; 0 when Postgres is not a local process). Deliveries are run with a pause of ``--idle-ms``
before every one (0: back to back, as at saturation). The paths run one after the other, not interleaved:
compare them across repeated runs. Prints the table and writes bench/results/consumer_statements.json.

    .venv/bin/python bench/consumer_statements.py [--consumer shipping] [--deliveries 200] [--idle-ms 0] \
        [--entity-version 1] [--driver psycopg2|psycopg] [--no-prepare]

``--driver`` runs every path on that Postgres driver (psycopg 3 prepares a statement on the server after 5 runs on
a connection; ``--no-prepare`` turns that off, ``prepare_threshold=None``, as behind PgBouncer before 1.21).

``--consumer`` names one of the reference deployment's consumers, or ``search_in_order``: its search effect
as a per-entity ordered consumer (``ordering=True``; consumers/search.py), which the deployment does not run.
``--entity-version V`` makes every delivery version V of its order's entity (default 1): versions 1 to V - 1 of
each are delivered first, untimed, so an ordered consumer measures the advance of an entity it has seen.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import event

from bench._common import add_driver_option, fresh_database, write_result
from celery_outbox.clock import SystemClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.delivery import DeliveryContext, deliver_with
from celery_outbox.inbox.claim import NOW_KEY, claim_if_absent
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import define_tables
from celery_outbox.settings import Settings
from consumers import default_registry
from consumers.search import search_in_order
from consumers.testing import order_placed_envelope

KINDS = ("statements", "pings", "commits", "rollbacks", "checkouts")
CPU = ("cpu_us", "pg_cpu_us")
TICKS = os.sysconf("SC_CLK_TCK")


def backend_cpu_s(pids: set[int]) -> float:
    """CPU seconds (user + system) the Postgres backends ``pids`` have used; 0 for one not readable here."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICKS


class Counting:
    """Counts an engine's round trips by kind (``KINDS``); ``texts`` keeps each statement's first words."""

    def __init__(self, engine: Any) -> None:
        self.counts: Counter[str] = Counter()
        self.texts: Counter[str] = Counter()
        dialect = engine.dialect
        ping = dialect.do_ping

        def do_ping(dbapi_connection: Any) -> bool:
            self.counts["pings"] += 1
            return bool(ping(dbapi_connection))

        dialect.do_ping = do_ping

        @event.listens_for(engine, "before_cursor_execute")
        def _stmt(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            self.counts["statements"] += 1
            self.texts[" ".join(statement.split()[:4])] += 1

        @event.listens_for(engine, "commit")
        def _commit(conn: Any) -> None:
            self.counts["commits"] += 1

        @event.listens_for(engine, "rollback")
        def _rollback(conn: Any) -> None:
            self.counts["rollbacks"] += 1

        @event.listens_for(engine, "checkout")
        def _checkout(*args: Any) -> None:
            self.counts["checkouts"] += 1

        self.backends: set[int] = set()

        @event.listens_for(engine, "connect")
        def _connect(dbapi_connection: Any, record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("SELECT pg_backend_pid()")
            self.backends.add(int(cursor.fetchone()[0]))
            cursor.close()
            dbapi_connection.rollback()

    def reset(self) -> None:
        self.counts.clear()
        self.texts.clear()


def print_round_trips(title: str, out: dict[str, dict[str, Any]]) -> None:
    """One line per path with its round trips by kind, then its statements by first words."""
    print(title)
    kinds = KINDS + tuple(k for k in CPU if all(k in row for row in out.values()))
    print(f"{'path':24}" + "".join(f"{k:>11}" for k in kinds))
    for label, row in out.items():
        print(f"{label:24}" + "".join(f"{row[k]:11.2f}" for k in kinds))
        for text, c in row["per_statement"].items():
            print(f"    {c:5.2f}  {text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--consumer", default="shipping")
    parser.add_argument("--deliveries", type=int, default=200)
    parser.add_argument("--idle-ms", type=float, default=0.0, help="pause before each delivery")
    parser.add_argument("--entity-version", type=int, default=1,
                        help="each delivery is this version of its entity (earlier ones delivered first, untimed)")
    add_driver_option(parser)
    parser.add_argument("--no-prepare", action="store_true", help="psycopg 3: prepare_threshold=None")
    args = parser.parse_args()
    if args.no_prepare and args.driver != "psycopg":
        parser.exit(2, "--no-prepare needs --driver psycopg\n")
    n, pause = args.deliveries, args.idle_ms / 1000
    spec = search_in_order if args.consumer == "search_in_order" else default_registry()[args.consumer]
    tables, clock, settings = define_tables(), SystemClock(), Settings()
    out: dict[str, Any] = {}
    with fresh_database(driver=args.driver) as url:
        connect_args: dict[str, Any] = {"prepare_threshold": None} if args.no_prepare else {}
        engine = make_engine(url, settings=settings, connect_args=connect_args)
        driver = engine.dialect.driver
        sessions = make_session_factory(engine)
        counting = Counting(engine)

        def first(i: int, tag: str, version: int = args.entity_version) -> Envelope:
            return order_placed_envelope(f"{tag}-{i}", version=version)

        def run(label: str, one: Any) -> None:
            one(-1)  # warm-up: the pool's first connection, statement caches
            counting.reset()
            cpu, pg_cpu = time.process_time(), backend_cpu_s(counting.backends)
            for i in range(n):
                if pause:
                    time.sleep(pause)
                one(i)
            cpu, pg_cpu = time.process_time() - cpu, backend_cpu_s(counting.backends) - pg_cpu
            out[label] = {k: round(counting.counts[k] / n, 3) for k in KINDS}
            out[label].update(cpu_us=round(cpu / n * 1e6, 1), pg_cpu_us=round(pg_cpu / n * 1e6, 1))
            out[label]["per_statement"] = {t: round(c / n, 3) for t, c in counting.texts.most_common()}

        # Bodies are JSON text before the clock starts, as a task receives them; the context is the consumer
        # task's (``consumer_tasks.context_source``: built at the first delivery, then reused).
        texts = {i: json.dumps(first(i, "dup").to_dict()) for i in range(-1, n)}
        plain_texts = {i: json.dumps(first(i, "plain").to_dict()) for i in range(-1, n)}
        claimed_texts = {i: json.dumps(first(i, "claimed").to_dict()) for i in range(-1, n)}
        context = DeliveryContext.build(spec, tables=tables, settings=settings, clock=clock)
        for i in range(-1, n):  # the entity's earlier versions, untimed (--entity-version)
            for version in range(1, args.entity_version):
                r = deliver_with(context, sessions, json.dumps(first(i, "dup", version).to_dict()), request_id=None,
                                 first_delivery=True)
                assert r.outcome is Outcome.PROCESSED, r

        def outbox_first(i: int) -> None:
            r = deliver_with(context, sessions, texts[i], request_id=None, first_delivery=True)
            assert r.outcome is Outcome.PROCESSED, r

        def outbox_duplicate(i: int) -> None:
            r = deliver_with(context, sessions, texts[i], request_id=None, first_delivery=True)
            assert r.outcome is Outcome.DUPLICATE, r

        def plain_envelope(text: str) -> Envelope:
            """What the plain twin does with the body kombu decoded (bench/_plain_worker.py)."""
            body = json.loads(text)
            return Envelope(message_id=uuid.UUID(body["message_id"]), type=body["type"], payload=body["payload"],
                            headers=dict(body["headers"]), created_at_ms=int(body["created_at_ms"]))

        def plain(i: int, *, claim: bool = False) -> None:
            envelope = plain_envelope((claimed_texts if claim else plain_texts)[i])
            with sessions() as session:
                now = clock.now_ms()
                session.info[NOW_KEY] = now
                if spec.prepare is not None:
                    spec.prepare(session, envelope)
                if claim:
                    assert claim_if_absent(session, envelope, tables=tables, consumer=spec.name, now_ms=now)
                spec.handler(session, envelope)
                session.commit()

        run("outbox_first_delivery", outbox_first)
        run("outbox_duplicate", outbox_duplicate)
        run("plain_task", plain)
        run("plain_with_claim", lambda i: plain(i, claim=True))
        engine.dispose()
    prepared = " (no prepare)" if args.no_prepare else ""
    print_round_trips(f"{args.consumer} on {driver}{prepared}: round trips per delivery ({n} deliveries each, entity "
                      f"version {args.entity_version}, idle {args.idle_ms} ms before each)", out)
    write_result("consumer_statements", {"consumer": args.consumer, "deliveries": n, "idle_ms": args.idle_ms,
                                         "entity_version": args.entity_version, "driver": driver,
                                         "no_prepare": args.no_prepare, "per_delivery": out})


if __name__ == "__main__":
    main()
