"""Retention prunes only what it should, in batches of short DELETEs, never below the redelivery window."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.errors import ValidationError
from celery_outbox.ops import retention
from celery_outbox.schema import Tables
from tests.ops_seed import T0, inbox_rows, outbox_row

DAY = 86_400_000
WINDOW = DAY


@pytest.fixture
def deletes(sqlite_engine: sa.Engine) -> Iterator[list[str]]:
    """Every DELETE statement the engine runs."""
    seen: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_a: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE"):
            seen.append(statement)

    sa.event.listen(sqlite_engine, "before_cursor_execute", count)
    yield seen
    sa.event.remove(sqlite_engine, "before_cursor_execute", count)


def counts(sessions: sessionmaker[Session], tables: Tables) -> dict[str, int]:
    ob = tables.outbox
    with sessions() as s:
        return {
            "inbox": int(s.scalar(sa.select(sa.func.count()).select_from(tables.inbox)) or 0),
            "published": int(s.scalar(sa.select(sa.func.count()).select_from(ob)
                                      .where(ob.published_at_ms.is_not(None))) or 0),
            "pending": int(s.scalar(sa.select(sa.func.count()).select_from(ob)
                                    .where(ob.published_at_ms.is_(None), ob.dead_lettered_at_ms.is_(None))) or 0),
            "dead": int(s.scalar(sa.select(sa.func.count()).select_from(ob)
                                 .where(ob.dead_lettered_at_ms.is_not(None))) or 0),
            "receipts": int(s.scalar(sa.select(sa.func.count()).select_from(tables.receipts)) or 0),
        }


def test_prune_deletes_only_old_rows_in_batches(sqlite_sessions: sessionmaker[Session], deletes: list[str],
                                                clock: ManualClock, tables: Tables) -> None:
    # Given 12 old and 3 recent inbox rows, 7 old and 2 recent published rows, old pending and dead rows
    clock.set(T0 + 10 * DAY)
    with sqlite_sessions() as s:
        inbox_rows(s, tables=tables, consumer="shipping", processed_at_ms=T0, n=8)
        inbox_rows(s, tables=tables, consumer="billing", processed_at_ms=T0 + DAY, n=4)
        inbox_rows(s, tables=tables, consumer="billing", processed_at_ms=T0 + 9 * DAY + 1, n=3)  # inside 1 day: kept
        for _ in range(7):
            outbox_row(s, tables=tables, created_at_ms=T0, published_at_ms=T0 + 5 * DAY)
        for _ in range(2):
            outbox_row(s, tables=tables, created_at_ms=T0, published_at_ms=T0 + 10 * DAY - 1000)
        outbox_row(s, tables=tables, created_at_ms=T0)  # pending for 10 days: never pruned
        outbox_row(s, tables=tables, created_at_ms=T0, dead_lettered_at_ms=T0, attempts=10)  # dead: never pruned
        # and 6 old task receipts (plain tasks that reached a worker) and one recent one
        s.add_all([tables.receipts(task_id=uuid.uuid4(), received_at_ms=T0) for _ in range(6)])
        s.add(tables.receipts(task_id=uuid.uuid4(), received_at_ms=T0 + 10 * DAY - 1000))
        s.commit()
    # When pruning inbox > 1 day and published > 1 day with batches of 5
    report = retention.prune(sqlite_sessions, tables=tables, inbox_older_than_ms=DAY, published_older_than_ms=DAY, batch=5,
                             clock=clock, redelivery_window_ms=WINDOW)
    # Then exactly the old rows went, 5 at a time: 12 -> 5+5+2 (3 DELETEs), receipts at the inbox's cutoff
    # 6 -> 5+1 (2 DELETEs), 7 -> 5+2 (2 DELETEs)
    assert (report.inbox_deleted, report.inbox_batches) == (12, 3)
    assert report.receipts_deleted == 6
    assert (report.outbox_deleted, report.outbox_batches) == (7, 2)
    assert len(deletes) == 7
    assert all("IN (SELECT" in d.upper().replace("\n", " ") for d in deletes)
    assert counts(sqlite_sessions, tables) == {"inbox": 3, "published": 2, "pending": 1, "dead": 1, "receipts": 1}


def test_exact_multiple_of_batch_needs_one_empty_probe(sqlite_sessions: sessionmaker[Session],
                                                       deletes: list[str], clock: ManualClock, tables: Tables) -> None:
    clock.set(T0 + 10 * DAY)
    with sqlite_sessions() as s:
        inbox_rows(s, tables=tables, consumer="shipping", processed_at_ms=T0, n=10)
    report = retention.prune(sqlite_sessions, tables=tables, inbox_older_than_ms=2 * DAY, published_older_than_ms=None,
                             batch=5, clock=clock, redelivery_window_ms=WINDOW)
    assert (report.inbox_deleted, report.inbox_batches, report.outbox_batches) == (10, 3, 0)
    assert len(deletes) == 4  # 5 + 5 + an empty probe, and one (empty) receipts batch


def test_refuses_to_prune_the_inbox_inside_the_redelivery_window(sqlite_sessions: sessionmaker[Session],
                                                                 deletes: list[str], clock: ManualClock, tables: Tables) -> None:
    # Given inbox rows two hours old and a one-day redelivery window
    clock.set(T0 + 2 * 3_600_000)
    with sqlite_sessions() as s:
        inbox_rows(s, tables=tables, consumer="shipping", processed_at_ms=T0, n=4)
        outbox_row(s, tables=tables, created_at_ms=T0, published_at_ms=T0)
    # When asked to prune the inbox older than one hour
    with pytest.raises(ValidationError, match="redelivery window"):
        retention.prune(sqlite_sessions, tables=tables, inbox_older_than_ms=3_600_000, published_older_than_ms=0, batch=5,
                        clock=clock, redelivery_window_ms=WINDOW)
    # Then nothing at all was deleted (the outbox part is refused too)
    assert deletes == []
    assert counts(sqlite_sessions, tables)["inbox"] == 4 and counts(sqlite_sessions, tables)["published"] == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"inbox_older_than_ms": None, "published_older_than_ms": None}, "nothing to prune"),
    ({"inbox_older_than_ms": DAY, "published_older_than_ms": DAY, "batch": 0}, "batch must be > 0"),
    ({"inbox_older_than_ms": None, "published_older_than_ms": -1}, "must be >= 0"),
])
def test_bad_arguments(sqlite_sessions: sessionmaker[Session], clock: ManualClock, kwargs: dict[str, Any],
                       message: str, tables: Tables) -> None:
    with pytest.raises(ValidationError, match=message):
        retention.prune(sqlite_sessions, tables=tables, clock=clock, redelivery_window_ms=WINDOW, **kwargs)


def test_beat_task_prunes_with_defaults_that_respect_the_window(settings: Any, sqlite_sessions: Any,
                                                                tables: Tables) -> None:
    from celery import Celery
    from freezegun import freeze_time

    from celery_outbox import Outbox
    from celery_outbox.celery.config import PRUNE_TASK

    app = Celery("t", set_as_current=False)
    app.conf.task_always_eager = True
    Outbox(app, settings=settings.replace(broker_redelivery_window_ms=30 * DAY, metrics_port=0),
           session_factory=sqlite_sessions)  # defines the prune task on the app
    with sqlite_sessions() as s:
        inbox_rows(s, tables=tables, consumer="shipping", processed_at_ms=T0, n=2)  # 10 days old: inside a 30-day window
        outbox_row(s, tables=tables, created_at_ms=T0, published_at_ms=T0)
    with freeze_time("2023-11-24T22:13:20Z"):  # T0 + 10 days
        result = app.tasks[PRUNE_TASK].apply().get()
    assert result["inbox_deleted"] == 0 and result["outbox_deleted"] == 1
    assert counts(sqlite_sessions, tables)["inbox"] == 2


def test_the_celery_app_registers_prune_and_beat_schedules_it(settings: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # relay.app builds its module-level app at import: keep it off the embedded broker
    monkeypatch.setenv("OUTBOX_BROKER_URL", "memory://")
    monkeypatch.setenv("OUTBOX_HOME", str(settings.home))
    monkeypatch.setenv("OUTBOX_METRICS_PORT", "0")
    from celery_outbox.celery.config import PRUNE_TASK
    from celeryconfig import celery_config
    from relay.app import create_celery_app

    app = create_celery_app(settings, broker_url="memory://")
    assert {PRUNE_TASK, "celery_outbox.drain", "celery_outbox.reconcile", "consumers.shipping"} <= set(app.tasks)
    assert app.conf.beat_schedule["reconcile-outbox"]["task"] == "celery_outbox.reconcile"
    entry = celery_config(settings, "memory://")["beat_schedule"]["prune-retention"]
    assert entry["task"] == "celery_outbox.prune" and entry["options"]["queue"] == f"{settings.namespace}.relay"
