"""The inbox claim's CPU in the worker: through SQLAlchemy Core (``sql.insert_if_absent``) vs as SQL text
compiled once per connection (``inbox.claim.claim_if_absent`` on psycopg 2/3: ``claim.driver_sql``).

The same ``INSERT ... ON CONFLICT DO NOTHING`` of the same rows, one round trip each, in one process on
one pooled connection (an engine built like the worker's, ``db.make_engine``), the two ways interleaved
in blocks of 100 claims, each block in a transaction rolled back after it. Reports the median over the
blocks of ``time.process_time`` per claim (this process: Python, SQLAlchemy, the driver), and writes
bench/results/consumer_claim.json.

    .venv/bin/python bench/consumer_claim.py [--claims 6000] [--driver psycopg2|psycopg]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy.orm import Session

from bench._common import fresh_database, write_result
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.inbox.claim import claim_if_absent
from celery_outbox.messages import Envelope
from celery_outbox.schema import define_tables
from celery_outbox.settings import Settings
from celery_outbox.sql import insert_if_absent
from consumers.testing import order_placed_envelope

BLOCK = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--claims", type=int, default=6000, help="claims per way")
    parser.add_argument("--driver", choices=("psycopg2", "psycopg"), default="psycopg2")
    args = parser.parse_args()
    tables = define_tables()
    table = tables.table(tables.inbox)
    envelopes = [order_placed_envelope(f"claim-{i}") for i in range(BLOCK)]

    def core(session: Session, envelope: Envelope) -> bool:
        return insert_if_absent(session, table, ("message_id", "consumer"), {
            "message_id": envelope.message_id, "consumer": "core", "type": envelope.type, "processed_at_ms": 1})

    def driver(session: Session, envelope: Envelope) -> bool:
        return claim_if_absent(session, envelope, tables=tables, consumer="driver", now_ms=1)

    ways: dict[str, Callable[[Session, Envelope], bool]] = {"sqlalchemy_core": core, "driver_sql": driver}
    per_block: dict[str, list[float]] = {k: [] for k in ways}
    with fresh_database() as url:
        engine = make_engine(url.replace("postgresql://", f"postgresql+{args.driver}://", 1), settings=Settings())
        sessions = make_session_factory(engine)
        with sessions() as session:
            for way in ways.values():  # warm-up: the connection, both statement caches
                assert way(session, envelopes[0])
            session.rollback()
            for _ in range(max(1, args.claims // BLOCK)):
                for name, way in ways.items():
                    start = time.process_time()
                    for envelope in envelopes:
                        way(session, envelope)
                    per_block[name].append((time.process_time() - start) / BLOCK * 1e6)
                    session.rollback()
        engine.dispose()
    out = {name: round(statistics.median(v), 1) for name, v in per_block.items()}
    print(f"inbox claim, CPU us per claim in this process ({args.driver}, median of {len(per_block['driver_sql'])} "
          f"blocks of {BLOCK} per way):")
    for name, value in out.items():
        print(f"  {name:16} {value:8.1f}")
    print(f"  ratio driver_sql / sqlalchemy_core: {out['driver_sql'] / out['sqlalchemy_core']:.2f}")
    write_result("consumer_claim", {"driver": args.driver, "claims_per_way": args.claims, "cpu_us_per_claim": out})


if __name__ == "__main__":
    main()
