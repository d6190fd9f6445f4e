"""A stored outbox row whose headers are no JSON object (written by raw SQL, another writer, a repair script) is
dead-lettered by the relay saying why, and the rows behind it are published, on SQLite and on Postgres (whose claim
stamps the batch published before it is built). Before, reading its headers raised in every batch that claimed
the row, each batch was rolled back, and the relay published nothing behind it, for ever; and once
dead-lettered, the row made every list of dead letters (CLI, admin pages) fail."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.ops import dead_letters
from celery_outbox.schema import Tables
from celery_outbox.testing.memory import InMemoryPublisher
from tests.unit.test_relay_dispatch import run


@pytest.mark.parametrize("headers", ["h", 5, [["a", "b"]], True])
def test_a_row_whose_headers_are_no_object_is_dead_lettered_and_the_rows_behind_it_go_out(
        any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables, headers: Any) -> None:
    # Given a pending row whose headers are a JSON string, number, array or boolean, ahead of a good row
    bad, good = uuid.uuid4(), uuid.uuid4()
    with any_sessions() as s:
        for mid, h in ((bad, headers), (good, {"correlation_id": "c-1"})):
            s.execute(sa.insert(tables.table(tables.outbox)).values(
                message_id=mid, type="OrderPlaced", payload={"order_id": "o-1"}, headers=h,
                created_at_ms=clock.now_ms(), next_attempt_at_ms=clock.now_ms(), attempts=0))
        s.commit()
    publisher = InMemoryPublisher()
    # When the relay runs a batch
    result = run(any_sessions, publisher, clock, tables)
    # Then the bad row is dead-lettered saying why, and the good one is published to every consumer
    assert (result.published, result.dead_lettered) == (1, 1), result
    assert {m.headers["outbox_message_id"] for m in publisher.published} == {str(good)}
    with any_sessions() as s:
        row = s.execute(sa.select(tables.outbox).where(tables.outbox.message_id == bad)).scalar_one()
    assert row.dead_lettered_at_ms is not None and row.published_at_ms is None
    assert "headers must be a JSON object" in str(row.last_error)
    # And the dead letters stay readable (the CLI's and the admin pages' list), showing the headers as stored
    with any_sessions() as s:
        (shown,) = dead_letters.list_dead_letters(s, tables=tables)
        assert dead_letters.get(s, shown.id, tables=tables).headers == headers == shown.to_dict(now_ms=0)["headers"]


@pytest.mark.parametrize("stored", ["deep", "long-number"])
def test_a_row_whose_stored_json_the_driver_cannot_decode_is_dead_lettered_and_the_rows_behind_it_go_out(
        any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables, stored: str) -> None:
    # Given a due row written by raw SQL whose payload the database keeps but Python cannot decode (nested 999
    # deep: SQLite keeps up to 1000 levels; a 5000-digit number: past Python's 4300), ahead of a good row
    payload = "[" * 999 + "]" * 999 if stored == "deep" else '{"n": ' + "7" * 5000 + "}"
    bad, good = uuid.uuid4(), uuid.uuid4()
    outbox = tables.table(tables.outbox)
    with any_sessions() as s:
        postgres = s.get_bind().dialect.name == "postgresql"
        for mid, text in ((bad, payload), (good, '{"order_id": "o-1"}')):
            s.execute(sa.text(f"INSERT INTO {outbox.name} (message_id, type, payload, headers, created_at_ms, "
                              "next_attempt_at_ms, attempts) VALUES (:m, 'OrderPlaced', :p, '{}', 0, 0, 0)"),
                      {"m": str(mid) if postgres else mid.hex, "p": text})
        s.commit()
    publisher = InMemoryPublisher()
    # When the relay runs batches until nothing is due
    results = [run(any_sessions, publisher, clock, tables) for _ in range(3)]
    # Then the bad row is dead-lettered saying why, and the good one is published to every consumer
    assert sum(r.dead_lettered for r in results) == 1 and sum(r.published for r in results) == 1, results
    assert {m.headers["outbox_message_id"] for m in publisher.published} == {str(good)}
    with any_sessions() as s:
        error = s.scalar(sa.select(outbox.c.last_error).where(outbox.c.dead_lettered_at_ms.is_not(None)))
    assert error is not None and "stored payload" in error
    # And the dead letters stay readable (the CLI's list and show, the admin pages), the payload shown as stored
    with any_sessions() as s:
        (shown,) = dead_letters.list_dead_letters(s, tables=tables)
        assert dead_letters.get(s, shown.id, tables=tables).payload == shown.payload
        assert isinstance(shown.payload, str) and shown.payload.replace(" ", "") == payload.replace(" ", "")
