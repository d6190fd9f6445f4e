"""``celery_outbox.ops.stats`` and the Prometheus collector: the figures after a scripted scenario, exactly."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.ops import stats as ops_stats
from celery_outbox.ops.metrics import OutboxCollector, make_registry, render
from celery_outbox.schema import Tables
from celeryconfig import Settings
from relay.web import create_app
from tests.ops_seed import T0, consumer_dead_letter, counter, inbox_rows, outbox_row


def scenario(s: Session, tables: Tables) -> None:
    outbox_row(s, tables=tables, created_at_ms=T0)  # oldest pending: 60 s old at T0 + 60 s
    outbox_row(s, tables=tables, created_at_ms=T0 + 30_000, attempts=2, last_error="nacked")  # retrying
    outbox_row(s, tables=tables, created_at_ms=T0, published_at_ms=T0 + 1)
    outbox_row(s, tables=tables, created_at_ms=T0, published_at_ms=T0 + 2)
    outbox_row(s, tables=tables, created_at_ms=T0, published_at_ms=T0 + 3)
    outbox_row(s, tables=tables, created_at_ms=T0, dead_lettered_at_ms=T0 + 20_000, attempts=10, last_error="too large")
    consumer_dead_letter(s, tables=tables, consumer="billing", failed_at_ms=T0 + 10_000)
    consumer_dead_letter(s, tables=tables, consumer="billing", failed_at_ms=T0 + 40_000)
    consumer_dead_letter(s, tables=tables, consumer="email", failed_at_ms=T0 + 50_000)
    inbox_rows(s, tables=tables, consumer="shipping", processed_at_ms=T0, n=3)
    inbox_rows(s, tables=tables, consumer="billing", processed_at_ms=T0, n=2)
    counter(s, tables=tables, consumer="shipping", name="duplicates", value=4)
    counter(s, tables=tables, consumer="billing", name="duplicates", value=1)
    counter(s, tables=tables, consumer="search", name="batches", value=3)  # a batch consumer (inbox/batch.py),
    counter(s, tables=tables, consumer="search", name="batches#77", value=1)  # one of its counters striped
    counter(s, tables=tables, consumer="search", name="batched_messages", value=50)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


EXPECTED: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {
    ("outbox_stats_up", ()): 1,
    ("outbox_pending_messages", ()): 2,
    ("outbox_due_messages", ()): 2,
    ("outbox_retrying_messages", ()): 1,
    ("outbox_scheduled_messages", ()): 0,
    ("outbox_oldest_pending_age_seconds", ()): 60.0,
    ("outbox_published_retained_messages", ()): 3,
    ("outbox_dead_letters", (("consumer", ""), ("source", "outbox"))): 1,
    ("outbox_dead_letters", (("consumer", "billing"), ("source", "consumer"))): 2,
    ("outbox_dead_letters", (("consumer", "email"), ("source", "consumer"))): 1,
    ("outbox_dead_letter_oldest_age_seconds", (("consumer", ""), ("source", "outbox"))): 40.0,
    ("outbox_dead_letter_oldest_age_seconds", (("consumer", "billing"), ("source", "consumer"))): 50.0,
    ("outbox_dead_letter_oldest_age_seconds", (("consumer", "email"), ("source", "consumer"))): 10.0,
    ("outbox_inbox_entries", (("consumer", "billing"),)): 2,
    ("outbox_inbox_entries", (("consumer", "shipping"),)): 3,
    ("outbox_duplicates_absorbed_total", (("consumer", "billing"),)): 1,
    ("outbox_duplicates_absorbed_total", (("consumer", "shipping"),)): 4,
    ("outbox_consumer_batches_total", (("consumer", "search"),)): 4,
    ("outbox_consumer_batched_messages_total", (("consumer", "search"),)): 50,
}


def test_stats_after_a_scripted_scenario(sqlite_session: Session, clock: ManualClock, tables: Tables) -> None:
    scenario(sqlite_session, tables)
    clock.set(T0 + 60_000)
    st = ops_stats.collect(sqlite_session, tables=tables, clock=clock).to_dict()
    assert st["outbox"] == {"pending": 2, "due": 2, "retrying": 1, "oldest_pending_age_ms": 60_000,
                            "published_retained": 3, "oldest_overdue_ms": 60_000, "claim_held_ms": None, "scheduled": 0,
                            "next_due_at_ms": None, "waiting_for_worker": []}
    assert st["dead_letters"]["total"] == 4 and st["dead_letters"]["oldest_age_ms"] == 50_000
    assert st["dead_letters"]["groups"] == [
        {"source": "outbox", "consumer": None, "count": 1, "oldest_age_ms": 40_000},
        {"source": "consumer", "consumer": "billing", "count": 2, "oldest_age_ms": 50_000},
        {"source": "consumer", "consumer": "email", "count": 1, "oldest_age_ms": 10_000},
    ]
    assert st["inbox"] == {"total": 5, "per_consumer": {"billing": 2, "shipping": 3}}
    assert st["duplicates_absorbed"] == {"total": 5, "per_consumer": {"billing": 1, "shipping": 4}}
    assert st["batches"] == {"search": {"batches": 4, "messages": 50, "mean_size": 12.5}}
    json.dumps(st)  # machine output must be plain JSON


def test_empty_database(sqlite_session: Session, clock: ManualClock, tables: Tables) -> None:
    st = ops_stats.collect(sqlite_session, tables=tables, clock=clock)
    assert (st.pending, st.oldest_pending_age_ms, st.dead_letter_total, st.oldest_dead_letter_age_ms) == \
        (0, None, 0, None)


def test_metrics_endpoint_on_the_flask_app(settings: Settings, sqlite_sessions: sessionmaker[Session],
                                           clock: ManualClock, tables: Tables) -> None:
    # Given the scenario, one minute later
    with sqlite_sessions() as s:
        scenario(s, tables)
    clock.set(T0 + 60_000)
    client = create_app(settings=settings, session_factory=sqlite_sessions, clock=clock).test_client()
    # When Prometheus scrapes /metrics
    r = client.get("/metrics")
    # Then every gauge has the scenario's value
    assert r.status_code == 200 and r.content_type.startswith("text/plain")
    got = samples(r.get_data(as_text=True))
    for key, value in EXPECTED.items():
        assert got.get(key) == value, key
    # And the ages follow the clock at scrape time
    clock.advance(60_000)
    got2 = samples(client.get("/metrics").get_data(as_text=True))
    assert got2[("outbox_oldest_pending_age_seconds", ())] == 120.0


def test_a_broken_database_reports_up_zero(clock: ManualClock, tmp_path: Any, tables: Tables) -> None:
    from celery_outbox.db import make_engine, make_session_factory

    sessions = make_session_factory(make_engine(f"sqlite:///{tmp_path / 'empty.db'}"))  # no tables
    registry = make_registry(tables=tables, session_factory=sessions, clock=clock)
    got = samples(render(registry).decode())
    assert got[("outbox_stats_up", ())] == 0
    assert ("outbox_pending_messages", ()) not in got


def test_registering_the_collector_does_not_touch_the_database(clock: ManualClock, tables: Tables) -> None:
    class Exploding:
        def __call__(self) -> Any:
            raise AssertionError("describe() must not open a session")

    collector = OutboxCollector(tables=tables, session_factory=Exploding(), clock=clock)  # type: ignore[arg-type]
    names = {m.name for m in collector.describe()}
    assert {"outbox_pending_messages", "outbox_oldest_pending_age_seconds", "outbox_dead_letters"} <= names
