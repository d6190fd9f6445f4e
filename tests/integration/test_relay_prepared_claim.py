"""The relay's claim as a server-side prepared statement on psycopg2 (celery_outbox/prepared.py): prepared once
per connection and run by name; a statement a transaction pooler lost falls back to the text, claim intact."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import counters
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.prepared import Prepared
from celery_outbox.relay import dispatch
from celery_outbox.relay.queries import RelayStatements
from celery_outbox.schema import Tables

pytestmark = [pytest.mark.postgres]


def test_the_prepared_form_numbers_each_parameter_once_and_is_named_by_its_text() -> None:
    prepared = Prepared(text="SELECT %(a)s, %(b)s, %(a)s, '50%%'", types={"b": "text", "a": "bigint"}, label="x")
    assert prepared.prepare_sql == f"PREPARE {prepared.name}(bigint, text) AS SELECT $1, $2, $1, '50%'"
    assert prepared.execute_sql == f"EXECUTE {prepared.name}(%(a)s, %(b)s)"
    assert Prepared(text="SELECT %(a)s, %(b)s, %(a)s, '50%%'", types={"a": "bigint", "b": "text"}, label="y").name \
        == prepared.name
    assert Prepared(text="SELECT %(a)s", types={"a": "bigint"}, label="x").name != prepared.name
    with pytest.raises(ValueError, match="no SQL type for parameter"):
        Prepared(text="SELECT %(a)s, %(c)s", types={"a": "bigint"}, label="x")


@pytest.fixture
def one_connection(pg_url: str) -> Iterator[tuple[sa.Engine, sessionmaker[Session], list[str]]]:
    """An engine of one pooled psycopg2 connection, and every statement it sends."""
    url = sa.make_url(pg_url).set(drivername="postgresql+psycopg2").render_as_string(hide_password=False)
    engine = make_engine(url, pool_size=1, max_overflow=0)
    sent: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda conn, cur, stmt, *a: sent.append(stmt.split("(")[0]))
    yield engine, make_session_factory(engine), sent
    engine.dispose()


def pending(engine: sa.Engine, tables: Tables, n: int) -> None:
    outbox = tables.table(tables.outbox)
    with engine.begin() as c:
        c.execute(outbox.insert(), [{"message_id": uuid.uuid4(), "type": "OrderPlaced", "payload": {}, "headers": {},
                                     "created_at_ms": 1, "next_attempt_at_ms": 1} for _ in range(n)])


def claim(sessions: sessionmaker[Session], statements: RelayStatements) -> int:
    assert statements.claim_mark_sql is not None
    with sessions() as s:
        rows, _, _ = dispatch.claimed_and_stamped(s, statements.claim_mark_sql, 10**13, 100,
                                                  prepared=statements.claim_mark_prepared)
        s.commit()
    return len(rows)


def test_the_claim_is_prepared_once_per_connection_and_then_run_by_name(
        one_connection: tuple[sa.Engine, sessionmaker[Session], list[str]], tables: Tables) -> None:
    """Given a relay on psycopg2 with one database connection
    When it claims three times
    Then the claim was prepared once on that connection and executed by name each time, claiming every row once"""
    engine, sessions, sent = one_connection
    statements = RelayStatements.build(tables, engine.dialect)
    prepared = statements.claim_mark_prepared
    assert prepared is not None
    claimed = []
    for n in (2, 3, 1):
        pending(engine, tables, n)
        claimed.append(claim(sessions, statements))
    assert claimed == [2, 3, 1]
    ours = [s for s in sent if s.startswith(("PREPARE", "EXECUTE", "WITH c AS"))]
    assert ours == [f"PREPARE {prepared.name}", f"EXECUTE {prepared.name}", f"EXECUTE {prepared.name}",
                    f"EXECUTE {prepared.name}"]
    with engine.connect() as c:
        names = c.exec_driver_sql("SELECT name FROM pg_prepared_statements").scalars().all()
    assert names == [prepared.name]
    with sessions() as s:
        published = s.execute(sa.select(sa.func.count()).select_from(tables.table(tables.outbox))
                              .where(tables.table(tables.outbox).c.published_at_ms.is_not(None))).scalar_one()
        total = counters.value(s, counters.RELAY, counters.PUBLISHED, tables=tables)
    assert (published, total) == (6, 6)


def test_a_claim_a_pooler_lost_is_sent_as_text_with_nothing_lost(
        one_connection: tuple[sa.Engine, sessionmaker[Session], list[str]], tables: Tables,
        caplog: pytest.LogCaptureFixture) -> None:
    """Given a relay whose connection lost its prepared claim (as a transaction pooler's next server connection
    has none)
    When it claims again
    Then the claim falls back to the text in a new transaction, claims every due row once, says so once,
    and sends the text from then on"""
    engine, sessions, sent = one_connection
    statements = RelayStatements.build(tables, engine.dialect)
    prepared = statements.claim_mark_prepared
    assert prepared is not None
    pending(engine, tables, 2)
    assert claim(sessions, statements) == 2
    with engine.connect() as c:  # the pool's one connection: as if the pooler moved us to another server
        c.exec_driver_sql("DEALLOCATE ALL")
        c.commit()
    pending(engine, tables, 3)
    sent.clear()
    with caplog.at_level(logging.WARNING, logger="celery_outbox.prepared"):
        assert claim(sessions, statements) == 3
    assert [r.getMessage() for r in caplog.records] == [
        "outbox: the relay's claim cannot stay prepared on the server (a transaction pooler such as PgBouncer?): "
        "sent as text from now on"]
    assert not prepared.enabled
    pending(engine, tables, 1)
    sent.clear()
    assert claim(sessions, statements) == 1
    assert [s for s in sent if s.startswith(("PREPARE", "EXECUTE", "WITH c AS"))] == ["WITH c AS "]
    with sessions() as s:
        outbox = tables.table(tables.outbox)
        published = s.execute(sa.select(sa.func.count()).select_from(outbox)
                              .where(outbox.c.published_at_ms.is_not(None))).scalar_one()
        total = counters.value(s, counters.RELAY, counters.PUBLISHED, tables=tables)
    assert (published, total) == (6, 6)
