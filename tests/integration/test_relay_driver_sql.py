"""The relay's claim and mark as SQL compiled once (``RelayStatements.claim_sql``/``mark_sql``) return what
SQLAlchemy's execution of the same statements returns, on psycopg 2 and psycopg 3: the same rows with the
same Python types (a UUID, decoded JSON), the same rows stamped, counted and the same next due time."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox import Tables, counters
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.relay.dispatch import ClaimedRow, RelayConfig, claim_due, mark_rows
from celery_outbox.relay.queries import RelayStatements
from tests.outbox_rows import insert_pending

pytestmark = pytest.mark.postgres


def _claim(session: Session, statements: RelayStatements, tables: Tables) -> list[ClaimedRow]:
    try:
        return claim_due(session, 10**15, 100, tables=tables, statements=statements)
    finally:
        session.rollback()


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_the_compiled_claim_and_mark_match_sqlalchemys(pg_url: str, tables: Tables, driver: str) -> None:
    engine = make_engine(pg_url.replace("postgresql://", f"postgresql+{driver}://", 1))
    sessions = make_session_factory(engine)
    try:
        # Given pending rows with JSON payloads and headers (nested, unicode, numbers, null)
        insert_pending(sessions, 1_000, 5, tables=tables,
                       payload=lambda i, mid: {"order": f"o-{i}", "n": i, "x": [1.5, None, {"é": True}]},
                       headers=lambda mid: {"trace": str(mid), "k": [1, 2]})
        built = RelayStatements.build(tables, engine.dialect)
        assert built.claim_sql is not None and built.mark_sql is not None
        through_sqlalchemy = replace(built, claim_sql=None, mark_sql=None)
        # When both claim them
        with sessions() as s:
            compiled_rows = _claim(s, built, tables)
        with sessions() as s:
            sqlalchemy_rows = _claim(s, through_sqlalchemy, tables)
        # Then the rows are the same, types included
        assert compiled_rows == sqlalchemy_rows and len(compiled_rows) == 5
        assert all(isinstance(r.message_id, uuid.UUID) and isinstance(r.payload, dict) for r in compiled_rows)
        # And marking the first three through the compiled mark stamps and counts them and reads the next due time
        config = RelayConfig(tables=tables, routes={}, max_message_bytes=10**6, max_attempts=5, base_delay_ms=1,
                             max_delay_ms=10, statements=built)
        with sessions() as s:
            rows = claim_due(s, 10**15, 100, tables=tables, statements=built)
            m = mark_rows(s, 2_000, config, published=rows[:3], failed={}, count=True)
            s.commit()
        assert (m.marked, m.next_due_ms, m.next_due_read) == (3, 1_000, True)
        with sessions() as s:
            assert counters.value(s, counters.RELAY, counters.PUBLISHED, tables=tables) == 3
            stamped = s.scalars(sa.select(tables.outbox.seq).where(tables.outbox.published_at_ms == 2_000)).all()
        assert sorted(stamped) == sorted(r.seq for r in rows[:3])
    finally:
        engine.dispose()


def test_a_schema_translate_map_runs_the_claim_through_sqlalchemy(pg_url: str, tables: Tables) -> None:
    # Given a relay engine that maps the tables' schema (compiled text would not see the map)
    engine = make_engine(pg_url).execution_options(schema_translate_map={None: "public"})
    sessions = make_session_factory(engine)
    seen: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda _c, _cur, statement, *_: seen.append(statement))
    try:
        insert_pending(sessions, 1_000, 2, tables=tables)
        # When it claims through its prebuilt statements
        with sessions() as s:
            rows = _claim(s, RelayStatements.build(tables, engine.dialect), tables)
        # Then SQLAlchemy ran the claim, the map applied
        assert len(rows) == 2
        assert any("SKIP LOCKED" in q and "public.outbox_messages" in q for q in seen), seen
    finally:
        engine.dispose()
