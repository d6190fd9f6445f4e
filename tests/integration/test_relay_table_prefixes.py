"""Review of the prebuilt claim and mark (issue #24, ``queries.RelayStatements``): two relays on two table
prefixes in one process and one Postgres database each claim, publish and mark their own rows, with
statements built for their own tables, and each wakes only for its own table's NOTIFY."""

from __future__ import annotations

import select
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import migrate
from celery_outbox.clock import ManualClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.relay.loop import RelayLoop
from celery_outbox.schema import define_tables
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings
from tests.conftest import scratch_database
from tests.outbox_rows import insert_pending

pytestmark = pytest.mark.postgres

PREFIXES = ("outbox_", "alt_")


@pytest.fixture(scope="module")
def two_prefix_url() -> Iterator[str]:
    with scratch_database("outbox_review") as url:
        for prefix in PREFIXES:
            migrate.upgrade(url, prefix=prefix)
        yield url


def test_two_relays_on_two_prefixes_in_one_process_each_publish_and_mark_their_own_rows(
        two_prefix_url: str, tmp_path: Path) -> None:
    clock = ManualClock()
    engine = make_engine(two_prefix_url)
    sessions: sessionmaker[Session] = make_session_factory(engine)
    tables = {p: define_tables(sa.MetaData(), prefix=p) for p in PREFIXES}
    publishers = {p: InMemoryPublisher() for p in PREFIXES}
    loops = {p: RelayLoop(settings=Settings(home=tmp_path, database_url=two_prefix_url, namespace=p.rstrip("_"),
                                            routes={"OrderPlaced": ("shipping",)}, table_prefix=p,
                                            relay_gather_ms=0, relay_poll_interval_s=0.05),
                          tables=tables[p], session_factory=sessions, publisher=publishers[p], clock=clock)
             for p in PREFIXES}
    try:
        for loop in loops.values():
            loop._ensure_listener()
        # Given pending rows in both prefixes' outboxes (3 and 2)
        ids = {p: insert_pending(sessions, clock.now_ms(), n, tables=tables[p]) for p, n in zip(PREFIXES, (3, 2), strict=True)}
        # When each relay drains, one after the other, in the same process
        drained = {p: loops[p].drain_once() for p in PREFIXES}
        # Then each published and marked exactly its own table's rows
        for p in PREFIXES:
            assert drained[p].published == len(ids[p])
            assert sorted(str(m.message_id) for m in publishers[p].published) == sorted(str(i) for i in ids[p])
            with sessions() as s:
                pending = s.execute(sa.select(sa.func.count()).select_from(tables[p].table(tables[p].outbox))
                                    .where(tables[p].outbox.published_at_ms.is_(None))).scalar()
            assert pending == 0
        # And their prebuilt statements name their own tables only
        for p, other in zip(PREFIXES, reversed(PREFIXES), strict=True):
            statements = loops[p].config.statements
            assert statements is not None and statements.mark is not None
            own, others = tables[p].names(), tables[other].names()
            for sql in (str(statements.claim.compile(engine)), str(statements.mark),
                        str(statements.next_due.compile(engine))):
                assert own[0] in sql and not any(name in sql for name in others), sql
        # And a commit to one prefix's outbox wakes that prefix's relay only
        for loop in loops.values():
            loop._wait()  # the notifications of the rows above were taken by the claims: ends by the poll
        insert_pending(sessions, clock.now_ms(), 1, tables=tables["alt_"])
        listener = loops["alt_"]._listener
        assert listener is not None and select.select([listener], [], [], 30)[0], "the NOTIFY never arrived"
        for loop in loops.values():
            loop._wait()
        assert (loops["outbox_"].stats.notify_wakeups, loops["alt_"].stats.notify_wakeups) == (0, 1)
        assert (loops["outbox_"].drain_once().published, loops["alt_"].drain_once().published) == (0, 1)
    finally:
        for loop in loops.values():
            loop.close()
        engine.dispose()
