"""The relay's claim statement sent as text (what psycopg2 does) against a server-side prepared statement.

psycopg2 sends every statement as text, which Postgres parses and plans at each run; the relay's claim
(``relay/queries.py``, ``claim_mark_pg``: claim, stamp, count and the next due time in one statement of
data-modifying CTEs) is the largest statement of its wake-up. This bench measures what the relay's server-side prepared
statement (celery_outbox/prepared.py: SQL ``PREPARE`` once per connection, then ``EXECUTE``) saves:
per round and mode, on a connection of its own to a fresh database, ``--claims`` times: another connection
commits two pending rows, then this one claims them with the statement and commits. It reads the CPU of this
process around the claim and its commit (``time.process_time``) and of the claiming connection's Postgres
backend (``/proc/<pid>/stat``, so Postgres must be local), per claim. Modes alternate within each round.

    .venv/bin/python bench/claim_prepare.py [--claims 2000] [--rounds 3]

A prepared statement does not survive a transaction pooler (PgBouncer in transaction mode moves a client's
transactions between server connections and tracks only protocol-level prepared statements): behind one the
relay sends the text (celery_outbox/prepared.py), and this measures what a direct connection saves.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg2
import sqlalchemy as sa

from bench._common import fresh_database, write_result
from celery_outbox import counters
from celery_outbox.prepared import Prepared
from celery_outbox.relay.queries import CLAIM_MARK_TYPES, claim_mark_pg
from celery_outbox.schema import define_tables

TICKS = os.sysconf("SC_CLK_TCK")
MODES = ("text", "prepared")


def backend_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def statements() -> tuple[str, Prepared]:
    """The claim as psycopg2 text, and as the relay prepares it (celery_outbox/prepared.py)."""
    dialect = sa.create_engine("postgresql+psycopg2://").dialect  # no connection
    text = str(claim_mark_pg(define_tables(), dialect).compile(dialect=dialect))
    return text, Prepared(text=text, types=CLAIM_MARK_TYPES, label="claim")


def run(dsn: str, mode: str, claims: int) -> dict[str, float]:
    text, prepared = statements()
    writer = psycopg2.connect(dsn)
    writer.autocommit = True
    relay = psycopg2.connect(dsn)
    try:
        cur, add = relay.cursor(), writer.cursor()
        cur.execute("SELECT pg_backend_pid()")
        pid = cur.fetchone()[0]
        relay.commit()
        if mode == "prepared":
            cur.execute(prepared.prepare_sql)
            relay.commit()
        params: dict[str, Any] = {"claim_limit": 100, "scope": "_relay", "name": "published",
                                  "stripe": counters.stripe_prefix("published")}
        cpu, before = 0.0, backend_ticks(pid)
        for _ in range(claims):
            add.execute("INSERT INTO outbox_messages (message_id, type, payload, headers, created_at_ms, "
                        "next_attempt_at_ms) VALUES (%s, 'E', '{}', '{}', 1, 1), (%s, 'E', '{}', '{}', 1, 1)",
                        (str(uuid.uuid4()), str(uuid.uuid4())))
            params["now_ms"] = int(time.time() * 1000)
            t = time.process_time()
            cur.execute(text if mode == "text" else prepared.execute_sql, params)
            rows = cur.fetchall()
            relay.commit()
            cpu += time.process_time() - t
            if len(rows) != 2:
                raise RuntimeError(f"{mode}: claimed {len(rows)} rows, expected 2")
        backend = (backend_ticks(pid) - before) / TICKS
        return {"client_us": round(cpu / claims * 1e6, 1), "backend_us": round(backend / claims * 1e6, 1)}
    finally:
        relay.close()
        writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--claims", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    out: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with fresh_database(prefix="outbox_claim_prepare") as url:
        dsn = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                out[mode].append(run(dsn, mode, args.claims))
                print(f"round {r} {mode:8s} per claim + commit: client {out[mode][-1]['client_us']:.0f} us, "
                      f"backend {out[mode][-1]['backend_us']:.0f} us", flush=True)
    med = {m: {k: statistics.median(x[k] for x in out[m]) for k in ("client_us", "backend_us")} for m in MODES}
    ratio = {k: round(med["prepared"][k] / med["text"][k], 3) for k in ("client_us", "backend_us")}
    print(f"median: text client {med['text']['client_us']:.0f} / backend {med['text']['backend_us']:.0f} us, "
          f"prepared {med['prepared']['client_us']:.0f} / {med['prepared']['backend_us']:.0f} us; "
          f"prepared / text: client {ratio['client_us']:.2f}, backend {ratio['backend_us']:.2f}")
    write_result("claim_prepare", {"claims": args.claims, "rounds": args.rounds, "runs": out, "median": med,
                                   "prepared_over_text": ratio, "load": os.getloadavg()})


if __name__ == "__main__":
    main()
