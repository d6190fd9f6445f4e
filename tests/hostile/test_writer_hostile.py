"""Hostile ordering headers at the writer: an event is either refused with a ``ValidationError`` before anything
is written, or it is one every ordered consumer applies in order, on SQLite and on Postgres (whose columns are
the strict ones). Accepted before: a key longer than the column (dead-lettered by every ordered consumer on
Postgres), a version past 64 bits (dead-lettered everywhere), and a bool version, an empty or non-text key or a
version without a key (ordering silently off)."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.errors import ValidationError
from celery_outbox.inbox import handle as inbox
from celery_outbox.inbox.ordering import entity_of
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from celery_outbox.writer import Event, outbox_values

KEYS = st.one_of(st.none(), st.sampled_from(["order:1", "", " ", "k\n", "k\x00", "\u202e", "\ud800", "k" * 200, "k" * 201,
                                             "k" * 10_000]),
                 st.integers(), st.text(max_size=210))
VERSIONS = st.one_of(st.none(), st.booleans(), st.sampled_from([0, -1, 1, 2**63 - 1, 2**63, 2**70, -(2**70)]),
                     st.integers(), st.floats(), st.text(max_size=3))


def applied(sessions: sessionmaker[Session], tables: Tables, env: Envelope) -> list[Any]:
    seen: list[Any] = []
    with sessions() as s:
        outcome = inbox.handle(s, env, tables=tables, consumer="ledger", handler=lambda _s, e: seen.append(e),
                               clock=ManualClock(), ordering=True)
    with sessions() as s:
        for table in (tables.inbox, tables.entity_versions, tables.parked):
            s.execute(sa.delete(table))
        s.commit()
    assert outcome is Outcome.PROCESSED
    return seen


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=KEYS, version=VERSIONS)
def test_ordering_headers_are_refused_or_applied_in_order(any_sessions: sessionmaker[Session], tables: Tables,
                                                         key: Any, version: Any) -> None:
    # Given an event with any entity_key and entity_version
    event = Event("OrderPlaced", {"n": 1}, entity_key=key, entity_version=version)
    # When the writer judges it
    try:
        values = outbox_values(event)
    except ValidationError as e:
        assert "entity_" in str(e) and len(str(e)) < 300  # one bounded line naming the header
        return
    # Then an accepted event with a key is one an ordered consumer applies, in order (version 1 first)
    env = Envelope(message_id=values["message_id"], type=values["type"], payload=values["payload"],
                   headers=values["headers"])
    if key is None:
        assert version is None and entity_of(env) is None
        return
    assert entity_of(env) == (key, version)
    if version == 1:
        assert len(applied(any_sessions, tables, env)) == 1


@pytest.mark.parametrize(("key", "version"), [("k" * 201, 1), ("order:1", True), ("order:1", 2**63), ("", 1), (5, 1),
                                              (None, 3), ("k\n", 1)])
def test_undeliverable_ordering_headers_are_refused(key: Any, version: Any) -> None:
    with pytest.raises(ValidationError, match="entity_"):
        outbox_values(Event("OrderPlaced", {}, entity_key=key, entity_version=version))
