"""The consumer dead-letter store: list, inspect, replay, purge; clear errors for bad ids/consumers."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.celery.sender import replay_sender
from celery_outbox.clock import ManualClock
from celery_outbox.errors import NotFoundError, OutboxError, ValidationError
from celery_outbox.inbox import attempts, dead_letters
from celery_outbox.outbox import Outbox
from celery_outbox.schema import Tables


def add(s: Session, tables: Tables, consumer: str, body: str, *, message_id: str | None = None) -> int:
    row = dead_letters.record(s, tables=tables, consumer=consumer, message_id=message_id or str(uuid.uuid4()),
                              type="OrderPlaced", body=body, headers={"h": 1}, delivery_count=3, last_error="E: boom",
                              first_failed_at_ms=1, last_failed_at_ms=2)
    s.commit()
    return row.id


MID = "11111111-2222-4333-8444-555555555555"


def test_list_get_filter_and_replay_marks(sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    with sqlite_sessions() as s:
        a = add(s, tables, "shipping", f'{{"message_id":"{MID}","type":"OrderPlaced","payload":{{}}}}')
        b = add(s, tables, "billing", "not json at all")
        assert [d.id for d in dead_letters.list_dead_letters(s, tables=tables)] == [a, b]
        assert [d.id for d in dead_letters.list_dead_letters(s, tables=tables, consumer="billing")] == [b]
        assert dead_letters.get(s, b, tables=tables).body == "not json at all"
        sent: list[tuple[str, dict[str, Any]]] = []
        dead_letters.replay(s, a, tables=tables, send=lambda c, e: sent.append((c, e)), clock=clock)
        assert sent == [("shipping", {"message_id": MID, "type": "OrderPlaced", "payload": {}})]
        assert [d.id for d in dead_letters.list_dead_letters(s, tables=tables)] == [b]
        assert [d.id for d in dead_letters.list_dead_letters(s, tables=tables, include_replayed=True)] == [a, b]
        assert dead_letters.get(s, a, tables=tables).replayed_at_ms == clock.now_ms()


def test_clear_errors(sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    with sqlite_sessions() as s:
        b = add(s, tables, "billing", "not json at all")
        with pytest.raises(NotFoundError, match="no consumer dead letter with id 999"):
            dead_letters.get(s, 999, tables=tables)
        with pytest.raises(NotFoundError, match="unknown consumer 'nope'"):
            dead_letters.list_dead_letters(s, tables=tables, consumer="nope", known_consumers=("shipping", "billing"))
        with pytest.raises(ValidationError, match="cannot be replayed"):
            dead_letters.replay(s, b, tables=tables, send=lambda c, e: None, clock=clock)
        # an object the consumers' own check refuses would only come back to the dead letters
        c = add(s, tables, "billing", '{"message_id":"x","type":5,"payload":{}}')
        with pytest.raises(ValidationError, match=r"dead letter \d+ \(billing\) is not a valid envelope .*message_id"):
            dead_letters.replay(s, c, tables=tables, send=lambda c, e: None, clock=clock)
        dead_letters.purge(s, [c], tables=tables)
        with pytest.raises(NotFoundError, match="id\\(s\\) 998, 999; nothing purged"):
            dead_letters.purge(s, [b, 998, 999], tables=tables)
        assert len(dead_letters.list_dead_letters(s, tables=tables)) == 1
    assert issubclass(NotFoundError, OutboxError)


def test_send_failure_leaves_it_unreplayed(sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    def down(consumer: str, envelope: dict[str, Any]) -> None:
        raise OSError("connection refused")

    with sqlite_sessions() as s:
        a = add(s, tables, "shipping", f'{{"message_id":"{MID}","type":"T","payload":{{}}}}')
        with pytest.raises(OSError):
            dead_letters.replay(s, a, tables=tables, send=down, clock=clock)
        assert dead_letters.get(s, a, tables=tables).replayed_at_ms is None


def test_purge_removes_rows_and_their_delivery_counts(sqlite_sessions: sessionmaker[Session],
                                                      clock: ManualClock, tables: Tables) -> None:
    mid = uuid.uuid4()
    with sqlite_sessions() as s:
        attempts.begin(s, tables=tables, key=mid, consumer="shipping", now_ms=1)
        a = add(s, tables, "shipping", "{}", message_id=str(mid))
        b = add(s, tables, "billing", "{}")
        assert dead_letters.purge(s, [a, a], tables=tables) == 1
        assert dead_letters.purge(s, [], tables=tables) == 0
        assert [d.id for d in dead_letters.list_dead_letters(s, tables=tables, include_replayed=True)] == [b]
        assert s.execute(sa.select(sa.func.count()).select_from(tables.attempts)).scalar_one() == 0


def test_celery_sender_routes_to_the_consumer_queue(outbox: Outbox) -> None:
    app, settings = outbox.app, outbox.settings
    calls: list[dict[str, Any]] = []

    def fake_send_task(name: str, **kw: Any) -> None:
        calls.append({"name": name, **kw})

    app.send_task = fake_send_task  # type: ignore[method-assign,assignment]
    send = replay_sender(app, outbox)
    mid = str(uuid.uuid4())
    send("billing", {"message_id": mid, "type": "OrderPlaced", "payload": {}})
    send("billing", {"message_id": mid, "type": "OrderPlaced", "payload": {}})
    first, second = calls
    # Every replay is a task of its own (a UUID per send): Flower keeps the dead letter's entry
    assert str(uuid.UUID(first.pop("task_id"))) != str(uuid.UUID(second.pop("task_id")))
    assert first == second == {"name": "consumers.billing",
                               "args": [{"message_id": mid, "type": "OrderPlaced", "payload": {}}],
                               "queue": f"{settings.namespace}.billing"}
    with pytest.raises(NotFoundError, match="unknown consumer 'nobody'"):
        send("nobody", {})
