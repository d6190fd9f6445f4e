"""What an idle reconcile pass costs the database: the standalone relay claims the lease and runs a pass
every few seconds, loaded or idle, so a pass that finds nothing must stay a handful of statements in as
few transactions, however many windows (consumers, tasks, plain tasks) it checks (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.schema import Tables
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings

# The demo deployment's shape: three event consumers, an @outbox.task, plain tasks on (their default)
ROUTES = {"OrderPlaced": ("shipping", "billing", "search")}
TASKS = frozenset({"orders.send_confirmation_email"})


class Statements:
    """Every statement the engine runs (its verb and first table) and every transaction it begins and ends."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.seen: list[str] = []
        self.ends: list[str] = []

    def __enter__(self) -> Statements:
        sa.event.listen(self.engine, "before_cursor_execute", self._sql)
        for name in ("begin", "commit", "rollback"):
            sa.event.listen(self.engine, name, getattr(self, f"_{name}"))
        return self

    def __exit__(self, *_: object) -> None:
        sa.event.remove(self.engine, "before_cursor_execute", self._sql)
        for name in ("begin", "commit", "rollback"):
            sa.event.remove(self.engine, name, getattr(self, f"_{name}"))

    def _sql(self, _c: object, _cur: object, statement: str, *_: object) -> None:
        words = [*" ".join(statement.split()).upper().split(" "), "", "", ""]
        if words[0] == "BEGIN":  # SQLite's, sent as a statement: counted with the transactions
            return
        self.seen.append(f"{words[0]} {words[words.index('FROM') + 1 if 'FROM' in words else 2]}".strip())

    def _begin(self, _c: object) -> None:
        self.ends.append("BEGIN")

    def _commit(self, _c: object) -> None:
        self.ends.append("COMMIT")

    def _rollback(self, _c: object) -> None:
        self.ends.append("ROLLBACK")


def test_an_idle_reconcile_pass_is_its_lease_claim_and_one_transaction_of_four_statements(
        tmp_path: Path, any_db_url: str, any_sessions: sessionmaker[Session], clock: ManualClock,
        tables: Tables) -> None:
    settings = Settings(home=tmp_path, database_url=any_db_url, namespace="rs", relay_reconcile_interval_s=5.0)
    loop = RelayLoop(settings=settings, tables=tables, session_factory=any_sessions, publisher=InMemoryPublisher(),
                     clock=clock, routes=ROUTES, idempotent_tasks=TASKS, listen=False)
    engine = any_sessions.kw["bind"]
    # Given a first pass (it sets every window's watermark) and nothing published since
    assert loop.reconcile_if_due() is not None
    clock.advance(5_000)
    # When the next pass is due
    with Statements(engine) as db:
        result = loop.reconcile_if_due()
    assert result is not None and (result.checked, result.plain_checked, result.republished) == (0, 0, 0)
    # Then the lease is claimed in one statement; and the pass, in one transaction, reads (and locks) its
    # counters, reads the consumers' progress, finds that nothing was published in any of its five windows'
    # spans (one query, not a page per window), and writes the counters that moved in one upsert
    prefix = tables.table(tables.counters).name.upper()
    outbox = tables.table(tables.outbox).name.upper()
    inbox = tables.table(tables.inbox).name.upper()
    assert db.seen == [f"INSERT {prefix}", f"SELECT {prefix}", f"SELECT {inbox}", f"SELECT {outbox}",
                       f"INSERT {prefix}"]
    assert db.ends == ["BEGIN", "COMMIT"] * 2
    loop.close()
