"""Hostile ordering headers at the writer and at an ordered consumer: an event is either refused with a
``ValidationError`` before anything is written, or it is one every ordered consumer applies in order, on SQLite and
on Postgres (whose columns are the strict ones); a delivery whose headers the writer would refuse (a hostile
producer's) is dead-lettered by an ordered consumer with that reason, never applied without ordering and never
taken as stale. Accepted before: a key longer than the column (dead-lettered by every ordered consumer on
Postgres), a version past 64 bits (dead-lettered everywhere), and a bool version, an empty or non-text key or a
version without a key (ordering silently off)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.consumer import consumer
from celery_outbox.delivery import deliver
from celery_outbox.entity_headers import entity_problem
from celery_outbox.errors import MalformedMessageError, ValidationError
from celery_outbox.inbox import handle as inbox
from celery_outbox.inbox.ordering import entity_of
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings
from celery_outbox.writer import Event, add, outbox_values

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


@pytest.mark.parametrize("payload", [[], [("order_id", "o-1")], ["ab"], None, "{}", 5, ("a", "b")])
def test_a_payload_that_is_not_an_object_is_refused_not_reshaped(payload: Any) -> None:
    # Given a payload that is no mapping (dict() would turn [("a", 1)] into {"a": 1}, ["ab"] into {"a": "b"})
    # Then the writer refuses it, saying what it got, instead of writing another object (or failing with a TypeError)
    with pytest.raises(ValidationError, match="payload must be a JSON object"):
        outbox_values(Event("OrderPlaced", payload))


@pytest.mark.parametrize("type_", ["Order\x00Placed", "\ud800", "Order\nPlaced", "\x1b[2J", "x" * 201])
def test_a_type_no_consumer_can_read_is_refused_in_a_message_that_can_be_shown(type_: str) -> None:
    with pytest.raises(ValidationError, match="event type must be at most 200 printable characters") as e:
        outbox_values(Event(type_, {"n": 1}))
    text = str(e.value)
    text.encode("utf-8")  # a lone surrogate in the message would fail every log handler and terminal
    assert text.isprintable() and len(text) < 200


@pytest.mark.parametrize("message_id", ["not-a-uuid", 5, None, "{11111111-1111-1111-1111-111111111111}",
                                        "urn:uuid:11111111-1111-1111-1111-111111111111",
                                        "11111111111111111111111111111111"])
def test_a_message_id_that_is_no_uuid_is_refused_at_publish_not_at_the_callers_commit(message_id: Any) -> None:
    with pytest.raises(ValidationError, match=r"message_id must be a uuid\.UUID"):
        outbox_values(Event("OrderPlaced", {}, message_id=message_id))


def test_a_message_id_in_canonical_text_is_written_as_its_uuid(sqlite_sessions: sessionmaker[Session],
                                                              tables: Tables) -> None:
    # Given an event whose id is a UUID's canonical text (the column's driver takes only uuid.UUID)
    mid = "11111111-2222-4333-8444-555555555555"
    # When it is added and committed with the caller's transaction
    with sqlite_sessions() as s:
        add(s, Event("OrderPlaced", {}, message_id=mid.upper()), tables=tables)  # type: ignore[arg-type]
        s.commit()
    # Then the row holds that UUID
    with sqlite_sessions() as s:
        assert str(s.scalar(sa.select(tables.outbox.message_id))) == mid


@consumer(name="ledger", event="OrderPlaced", ordering=True)
def ledger(session: Session, env: Envelope) -> None:
    """An ordered consumer with no effect of its own: the inbox and the entity rows are what is looked at."""


def delivered(sessions: sessionmaker[Session], tables: Tables, settings: Settings, headers: dict[str, Any]) -> tuple[
        Outcome, str | None]:
    """Deliver an envelope with ``headers`` to the ordered consumer as its task would, retrying while asked;
    the final outcome and the dead letter's reason (None when there is none). The store is emptied after."""
    env = {"message_id": "11111111-2222-4333-8444-555555555555", "type": "OrderPlaced", "payload": {"n": 1},
           "headers": headers, "created_at_ms": 0}
    clock = ManualClock()
    result = None
    for attempt in range(settings.consumer_max_deliveries + 1):
        result = deliver(sessions, ledger, env, tables=tables, request_id=None, settings=settings, clock=clock,
                         first_delivery=attempt == 0)
        if result.retry_in_s is None:
            break
        clock.advance(int(result.retry_in_s * 1000))
    assert result is not None and result.retry_in_s is None, result
    with sessions() as s:
        reasons = list(s.scalars(sa.select(tables.dead_letters.last_error)))
        for table in (tables.inbox, tables.entity_versions, tables.parked, tables.dead_letters, tables.attempts,
                      tables.counters):
            s.execute(sa.delete(table))
        s.commit()
    assert len(reasons) == (1 if result.outcome is Outcome.DEAD_LETTERED else 0)
    return result.outcome, reasons[0] if reasons else None


@pytest.mark.parametrize(("key", "version"), [("order:1", True), ("order:1", 1.0), ("order:1", "1"), ("order:1", None),
                                              ("order:1", 0), ("order:1", -1), ("order:1", 2**63), ("k\x00", 1),
                                              ("k" * 201, 1), ("", 1), (None, 3), (5, 1)])
def test_an_ordered_consumer_dead_letters_ordering_headers_the_writer_refuses(
        any_sessions: sessionmaker[Session], tables: Tables, settings: Settings, key: Any, version: Any) -> None:
    # Given a delivery whose ordering headers the writer would refuse (put on the queue by another producer)
    headers = {name: value for name, value in (("entity_key", key), ("entity_version", version)) if value is not None}
    with pytest.raises(ValidationError):
        outbox_values(Event("OrderPlaced", {}, entity_key=key, entity_version=version))
    # When the ordered consumer is delivered it until it stops asking for a retry
    outcome, reason = delivered(any_sessions, tables, settings, headers)
    # Then it is dead-lettered saying which header is wrong, the same on SQLite and Postgres: not processed without
    # ordering, not acknowledged as stale (no effect and no dead letter), not parked for ever
    assert outcome is Outcome.DEAD_LETTERED
    assert reason is not None and "entity_" in reason


@hsettings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=KEYS, version=st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False,
                                                                                       allow_infinity=False),
                                   st.sampled_from([0, -1, 1, 2, 2**63 - 1, 2**63]), st.text(max_size=3)))
def test_an_ordered_consumer_applies_exactly_what_the_writer_accepts(
        sqlite_sessions: sessionmaker[Session], tables: Tables, settings: Settings, key: Any, version: Any) -> None:
    # Given a delivery with any ordering headers
    headers = {name: value for name, value in (("entity_key", key), ("entity_version", version)) if value is not None}
    # When the ordered consumer is delivered it
    outcome, _reason = delivered(sqlite_sessions, tables, settings, headers)
    # Then what the writer's rule accepts is applied in order (processed, or parked awaiting version 1), and what it
    # refuses is dead-lettered
    if entity_problem(key, version) is None:
        assert outcome in (Outcome.PROCESSED, Outcome.PARKED)
    else:
        assert outcome is Outcome.DEAD_LETTERED


def test_entity_of_refuses_what_the_writer_refuses() -> None:
    # Given headers an ordered consumer cannot apply (a key without a version), Then entity_of says why
    env = Envelope(message_id=uuid.uuid4(), type="T", payload={}, headers={"entity_key": "k"})
    with pytest.raises(MalformedMessageError, match="entity_version"):
        entity_of(env)


@pytest.mark.parametrize(("field", "value"), [("correlation_id", 42), ("correlation_id", ["req-1"]),
                                              ("correlation_id", "r" * 201), ("correlation_id", "req\n1"),
                                              ("correlation_id", b"req-1"), ("causation_id", {"id": 1}),
                                              ("causation_id", 7), ("causation_id", "c\x1b[2J")])
def test_a_correlation_or_causation_id_no_trace_can_find_is_refused(field: str, value: Any) -> None:
    # Given an event whose correlation or causation id is no text, or text `outbox trace` could never be given
    # When the writer judges it; Then a ValidationError names the field (it was written as it was)
    with pytest.raises(ValidationError, match=f"{field} must be printable text of at most 200 characters") as e:
        outbox_values(Event("OrderPlaced", {"n": 1}, **{field: value}))
    assert str(e.value).isprintable()


def test_a_traceable_correlation_id_is_kept() -> None:
    values = outbox_values(Event("OrderPlaced", {}, correlation_id="req-" + "x" * 196, causation_id="c-1"))
    assert values["headers"]["correlation_id"] == "req-" + "x" * 196 and values["headers"]["causation_id"] == "c-1"
