"""The consumer dead-letter store: list, inspect, replay, purge; clear errors for bad ids/consumers."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from celeryconfig import Settings, celery_config
from consumers import attempts, dead_letters
from consumers.models import DeliveryAttempt
from outbox.clock import ManualClock
from outbox.errors import NotFoundError, OutboxError, ValidationError
from outbox.messages import task_id


def add(s: Session, consumer: str, body: str, *, message_id: str | None = None) -> int:
    row = dead_letters.record(s, consumer=consumer, message_id=message_id or str(uuid.uuid4()), type="OrderPlaced",
                              body=body, headers={"h": 1}, delivery_count=3, last_error="E: boom",
                              first_failed_at_ms=1, last_failed_at_ms=2)
    s.commit()
    return row.id


def test_list_get_filter_and_replay_marks(sqlite_sessions: sessionmaker[Session], clock: ManualClock) -> None:
    with sqlite_sessions() as s:
        a = add(s, "shipping", '{"message_id":"m","type":"OrderPlaced","payload":{}}')
        b = add(s, "billing", "not json at all")
        assert [d.id for d in dead_letters.list_dead_letters(s)] == [a, b]
        assert [d.id for d in dead_letters.list_dead_letters(s, consumer="billing")] == [b]
        assert dead_letters.get(s, b).body == "not json at all"
        sent: list[tuple[str, dict[str, Any]]] = []
        dead_letters.replay(s, a, send=lambda c, e: sent.append((c, e)), clock=clock)
        assert sent == [("shipping", {"message_id": "m", "type": "OrderPlaced", "payload": {}})]
        assert [d.id for d in dead_letters.list_dead_letters(s)] == [b]
        assert [d.id for d in dead_letters.list_dead_letters(s, include_replayed=True)] == [a, b]
        assert dead_letters.get(s, a).replayed_at_ms == clock.now_ms()


def test_clear_errors(sqlite_sessions: sessionmaker[Session], clock: ManualClock) -> None:
    with sqlite_sessions() as s:
        b = add(s, "billing", "not json at all")
        with pytest.raises(NotFoundError, match="no consumer dead letter with id 999"):
            dead_letters.get(s, 999)
        with pytest.raises(NotFoundError, match="unknown consumer 'nope'"):
            dead_letters.list_dead_letters(s, consumer="nope", known_consumers=("shipping", "billing"))
        with pytest.raises(ValidationError, match="cannot be replayed"):
            dead_letters.replay(s, b, send=lambda c, e: None, clock=clock)
        with pytest.raises(NotFoundError, match="id\\(s\\) 998, 999; nothing purged"):
            dead_letters.purge(s, [b, 998, 999])
        assert len(dead_letters.list_dead_letters(s)) == 1
    assert issubclass(NotFoundError, OutboxError)


def test_send_failure_leaves_it_unreplayed(sqlite_sessions: sessionmaker[Session], clock: ManualClock) -> None:
    def down(consumer: str, envelope: dict[str, Any]) -> None:
        raise OSError("connection refused")

    with sqlite_sessions() as s:
        a = add(s, "shipping", '{"message_id":"m","type":"T","payload":{}}')
        with pytest.raises(OSError):
            dead_letters.replay(s, a, send=down, clock=clock)
        assert dead_letters.get(s, a).replayed_at_ms is None


def test_purge_removes_rows_and_their_delivery_counts(sqlite_sessions: sessionmaker[Session],
                                                      clock: ManualClock) -> None:
    mid = uuid.uuid4()
    with sqlite_sessions() as s:
        attempts.begin(s, key=mid, consumer="shipping", now_ms=1)
        a = add(s, "shipping", "{}", message_id=str(mid))
        b = add(s, "billing", "{}")
        assert dead_letters.purge(s, [a, a]) == 1
        assert dead_letters.purge(s, []) == 0
        assert [d.id for d in dead_letters.list_dead_letters(s, include_replayed=True)] == [b]
        assert s.execute(sa.select(sa.func.count()).select_from(DeliveryAttempt)).scalar_one() == 0


def test_celery_sender_routes_to_the_consumer_queue(settings: Settings) -> None:
    app = Celery("sender-test", set_as_current=False)
    app.conf.update(celery_config(settings, "memory://"))
    calls: list[dict[str, Any]] = []

    def fake_send_task(name: str, **kw: Any) -> None:
        calls.append({"name": name, **kw})

    app.send_task = fake_send_task  # type: ignore[method-assign,assignment]
    send = dead_letters.celery_sender(app, settings)
    mid = str(uuid.uuid4())
    send("billing", {"message_id": mid, "type": "OrderPlaced", "payload": {}})
    assert calls == [{"name": "consumers.billing", "args": [{"message_id": mid, "type": "OrderPlaced", "payload": {}}],
                      "queue": f"{settings.namespace}.billing", "task_id": task_id(mid, "billing")}]
    with pytest.raises(NotFoundError, match="unknown consumer 'nobody'"):
        send("nobody", {})
