"""Hypothesis against the broker side, without a broker: every field of the envelope and of the
protocol-2 message, and raw bodies of any bytes, go through the worker's own gate
(``celery_outbox.celery.strategy.canonical_message``) and then ``deliver()`` on a real database,
redelivered the way Celery's retry would.

For every input: no exception escapes, every outcome is PROCESSED / DUPLICATE / DEAD_LETTERED /
RETRY, nothing is still being retried after the configured deliveries, and a message that ends
DEAD_LETTERED has its dead letter written, raw body recoverable. The dead-letter writer itself is
fuzzed on SQLite and Postgres with text neither can store as-is (NUL, lone surrogates).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, event, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.celery.strategy import canonical_message
from celery_outbox.clock import ManualClock
from celery_outbox.consumer import ConsumerSpec, consumer
from celery_outbox.delivery import deliver
from celery_outbox.errors import MalformedMessageError
from celery_outbox.inbox import dead_letters
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope, MalformedDelivery, decode_json, json_depth_exceeds
from celery_outbox.schema import Tables
from celeryconfig import Settings

MAX_DELIVERIES = 3
TASK = "consumers.fuzz"
OUTCOMES = {Outcome.PROCESSED, Outcome.DUPLICATE, Outcome.DEAD_LETTERED, Outcome.RETRY}
FUZZ = hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


@consumer(name="fuzz", event="OrderPlaced")
def fuzz(session: Session, env: Envelope) -> None:
    """Accepts any payload: a valid envelope of any content must be PROCESSED."""
    json.dumps(env.payload)


SPEC: ConsumerSpec = fuzz

# Text a database may refuse: NUL, lone surrogates, plus ordinary text.
nasty_char = st.sampled_from(["\x00", "\ud800", "\udfff", "\ufffe", "é", "\n", '"', "\\", "[", "{"])
nasty_text = st.lists(st.one_of(st.characters(), nasty_char), max_size=40).map("".join)
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                        nasty_text)
json_value = st.recursive(json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(nasty_text, inner, max_size=4)), max_leaves=20)


def deep_text(n: int) -> str:
    return "[" * n + "]" * n


any_field = json_value
message_ids = st.one_of(st.uuids().map(str), st.uuids().map(lambda u: "{" + str(u) + "}"), nasty_text,
                        st.integers(), st.none(), st.lists(st.integers(), max_size=2))
types = st.one_of(st.just("OrderPlaced"), st.just("OrderPlaced\x00"), st.just("x" * 201), nasty_text,
                  st.integers(), st.none())
payloads = st.one_of(json_value, json_value.map(json.dumps), nasty_text,
                     st.integers(min_value=60, max_value=3000).map(deep_text))
created = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.booleans(), st.floats(), st.none(),
                    nasty_text)


valid_envelopes = st.fixed_dictionaries({
    "message_id": st.uuids().map(str), "type": st.just("OrderPlaced"), "payload": json_value,
    "headers": st.dictionaries(nasty_text, json_value, max_size=3),
    "created_at_ms": st.integers(0, 2**63 - 1)})


@st.composite
def envelopes(draw: st.DrawFn) -> dict[str, Any]:
    if draw(st.integers(0, 3)) == 0:
        return draw(valid_envelopes)
    env: dict[str, Any] = {}
    for name, strategy in (("message_id", message_ids), ("type", types), ("payload", payloads),
                           ("headers", st.one_of(st.dictionaries(nasty_text, json_value, max_size=3), json_value)),
                           ("created_at_ms", created)):
        if draw(st.integers(0, 9)) > 0:  # each field sometimes missing
            env[name] = draw(strategy)
    if draw(st.booleans()):
        env.update(message_id=str(uuid.uuid4()), type="OrderPlaced")  # often a mostly valid one
    return env


@dataclass
class FakeMessage:
    """What the strategy reads of a kombu message."""

    body: bytes | str
    headers: Any
    content_type: Any = "application/json"
    content_encoding: Any = "utf-8"
    delivery_info: Any = field(default_factory=dict)
    properties: Any = field(default_factory=dict)


def dumps(value: Any) -> bytes:
    return json.dumps(value).encode("utf-8", "surrogatepass")


@st.composite
def raw_messages(draw: st.DrawFn) -> FakeMessage:
    """Any protocol-2 message: good triples, wrong shapes, raw bytes, hostile headers and properties."""
    env = draw(envelopes())
    body = draw(st.one_of(
        st.just(dumps([[env], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])),
        st.just(json.dumps([[env], {}, {"callbacks": None, "chain": None, "chord": None, "errbacks": None}],
                           separators=(",", ":")).encode()),  # the relay's exact frame (strategy._relay_envelope)
        st.just(dumps([[env], {}, {}])),
        st.just(dumps([[json.dumps(env)], {}, None])),
        any_field.map(dumps),
        st.tuples(any_field, any_field, any_field).map(lambda t: dumps(list(t))),
        st.just(dumps([[env], {"x": 1}, {}])),
        st.just(dumps([[env], {}, {"callbacks": [{"task": "celery.ping"}]}])),
        st.binary(max_size=200),
        st.integers(60, 5000).map(lambda n: ("[[" + deep_text(n) + "],{},{}]").encode()),
        nasty_text.map(lambda t: t.encode("utf-8", "surrogatepass")),
    ))
    headers = draw(st.one_of(
        st.just({"task": TASK, "id": str(uuid.uuid4()), "retries": 0}),
        st.fixed_dictionaries({"task": st.one_of(st.just(TASK), nasty_text, st.none())},
                              optional={"id": st.one_of(st.uuids().map(str), nasty_text, st.integers()),
                                        "retries": st.one_of(st.integers(), st.booleans(), nasty_text),
                                        "eta": st.one_of(nasty_text, st.datetimes().map(lambda d: d.isoformat())),
                                        "expires": nasty_text, "timelimit": json_value, "argsrepr": json_value,
                                        "origin": json_value, "shadow": json_value}),
        st.none(), json_value,
    ))
    return FakeMessage(
        body=draw(st.one_of(st.just(body), st.just(body.decode("utf-8", "surrogateescape")))),
        headers=headers,
        content_type=draw(st.one_of(st.just("application/json"), st.just("APPLICATION/JSON"), nasty_text,
                                    st.none())),
        content_encoding=draw(st.one_of(st.just("utf-8"), st.just("binary"), st.just("latin-1"), nasty_text,
                                        st.none())),
        delivery_info=draw(st.one_of(st.just({"redelivered": False}), st.dictionaries(nasty_text, json_value),
                                     st.none())),
        properties=draw(st.one_of(st.just({}), st.dictionaries(st.sampled_from(["priority", "reply_to"]),
                                                               json_value), st.none())),
    )


def clear(sessions: sessionmaker[Session], tables: Tables) -> None:
    with sessions() as s:
        for table in (tables.dead_letters, tables.attempts, tables.inbox, tables.counters):
            s.execute(sa.delete(table))
        s.commit()


def run_like_celery(sessions: sessionmaker[Session], tables: Tables, settings: Settings, clock: ManualClock,
                    arg: Any, request_id: str | None) -> Outcome:
    """Deliver ``arg`` as the consumer task would, retrying while asked (Celery's ``self.retry``)."""
    result = None
    for attempt in range(MAX_DELIVERIES + 1):
        result = deliver(sessions, SPEC, arg, tables=tables, request_id=request_id, settings=settings, clock=clock,
                         first_delivery=attempt == 0)
        assert result.outcome in OUTCOMES
        if result.retry_in_s is None:
            break
        clock.advance(int(result.retry_in_s * 1000))
    assert result is not None
    # Then nothing is retried past the configured deliveries
    assert result.retry_in_s is None and result.outcome is not Outcome.RETRY, result
    return result.outcome


def dead_letter_bodies(sessions: sessionmaker[Session], tables: Tables) -> list[bytes]:
    with sessions() as s:
        return [dead_letters.body_bytes(r.body) for r in s.execute(sa.select(tables.dead_letters)).scalars()]


@pytest.fixture
def fuzz_settings(settings: Settings) -> Settings:
    return settings.replace(consumer_max_deliveries=MAX_DELIVERIES, max_message_bytes=64 * 1024)


@FUZZ
@given(message=raw_messages())
def test_any_broker_message_ends_processed_or_dead_lettered(
        message: FakeMessage, fuzz_settings: Settings, sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given any broker message on the fuzz consumer's queue, and an empty store
    clear(sqlite_sessions, tables)
    clock = ManualClock()
    # When the worker's strategy turns it into the message Celery sees
    canonical = canonical_message(message, task_name=TASK, settings=fuzz_settings, route=("x", "x.fuzz"),
                                  max_eta_s=120.0)
    # Then Celery would see a well-formed protocol-2 message (nothing it can choke on)
    args, kwargs, embed = json.loads(canonical.body)
    assert kwargs == {} and not any(embed.values()) and len(args) == 1 and isinstance(args[0], str)
    assert canonical.headers["task"] == TASK and str(uuid.UUID(canonical.headers["id"])) == canonical.headers["id"]
    assert canonical.headers["expires"] is None and canonical.headers["timelimit"] == [None, None]
    # And delivering it (with Celery's retries) never raises and ends in a final outcome
    outcome = run_like_celery(sqlite_sessions, tables, fuzz_settings, clock, args[0], canonical.headers["id"])
    event(f"outcome {outcome.value}")
    if outcome is Outcome.DEAD_LETTERED:
        # And a dead letter is written, its raw body recoverable
        bodies = dead_letter_bodies(sqlite_sessions, tables)
        assert len(bodies) == 1
        malformed = MalformedDelivery.decode(args[0])
        expected = malformed.body if malformed is not None else args[0].encode("utf-8", "surrogatepass")
        assert bodies[0] == expected


@FUZZ
@given(env=envelopes())
def test_any_envelope_dict_ends_processed_or_dead_lettered(
        env: dict[str, Any], fuzz_settings: Settings, sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given any envelope object (the eager path: the task called with a dict)
    clear(sqlite_sessions, tables)
    # When delivered with retries, Then no exception escapes and the outcome is final
    outcome = run_like_celery(sqlite_sessions, tables, fuzz_settings, ManualClock(), env, None)
    # And a valid envelope is processed, anything else dead-lettered with its dead letter written
    try:
        valid = Envelope.from_dict(env, max_depth=fuzz_settings.max_json_depth).type == "OrderPlaced"
    except MalformedMessageError:
        valid = False
    assert outcome is (Outcome.PROCESSED if valid else Outcome.DEAD_LETTERED)
    assert len(dead_letter_bodies(sqlite_sessions, tables)) == (0 if valid else 1)


@FUZZ
@given(depth=st.integers(1, 400), wrap=st.sampled_from(["[", "{\"k\":"]), noise=nasty_text)
def test_depth_is_measured_exactly_and_deep_json_is_a_clear_error(depth: int, wrap: str, noise: str) -> None:
    # Given JSON nested ``depth`` deep, with brackets and quotes inside strings as noise
    close = "]" if wrap == "[" else "}"
    text = wrap * (depth - 1) + "[" + json.dumps(noise) + "]" + close * (depth - 1)
    # Then the scanner counts only real nesting, and decoding past the limit says so
    assert json_depth_exceeds(text, depth) is False and json_depth_exceeds(text, depth - 1) is True
    if depth > 64:
        with pytest.raises(MalformedMessageError, match="nested deeper than 64"):
            decode_json(text, max_depth=64)
    else:
        assert decode_json(text, max_depth=64) is not None


def test_nesting_past_the_interpreter_recursion_limit_is_refused_everywhere() -> None:
    # Given an envelope whose payload string is nested 100 000 deep
    payload = "[" * 100_000 + "]" * 100_000
    env = {"message_id": str(uuid.uuid4()), "type": "OrderPlaced", "payload": payload}
    # Then the envelope, the payload and a dead-letter replay refuse it with a clear error
    with pytest.raises(MalformedMessageError, match="payload is nested deeper than 64"):
        Envelope.from_dict(env)
    with pytest.raises(MalformedMessageError, match="envelope is nested deeper than 64"):
        Envelope.from_dict('{"a":' * 100_000 + "1" + "}" * 100_000)


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(nasty_text, st.binary(max_size=100)), type_=st.one_of(nasty_text, st.none()),
       headers=st.one_of(json_value, st.dictionaries(nasty_text, json_value, max_size=3)), error=nasty_text,
       message_id=nasty_text)
def test_a_dead_letter_can_always_be_written_and_read_back(
        body: str | bytes, type_: str | None, headers: Any, error: str, message_id: str,
        any_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given content neither SQLite nor Postgres can store as-is (NUL, lone surrogates, raw bytes)
    with any_sessions() as s:
        # When it is recorded as a dead letter, with an error text past the column's size
        row = dead_letters.record(s, tables=tables, consumer="fuzz", message_id=message_id, type=type_, body=body,
                                  headers=headers, delivery_count=3, last_error=error * 1000,
                                  first_failed_at_ms=1, last_failed_at_ms=2)
        s.commit()
        rid = row.id
    # Then it is stored, and the raw body comes back exactly
    with any_sessions() as s:
        stored = dead_letters.get(s, rid, tables=tables)
        raw = body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass")
        assert dead_letters.body_bytes(stored.body) == raw
        if isinstance(body, str):
            assert dead_letters.body_of(stored.body) == body
        assert len(stored.last_error) <= dead_letters.ERROR_MAX_CHARS
        s.execute(sa.delete(tables.dead_letters).where(tables.dead_letters.id == rid))
        s.commit()


def test_replay_gives_back_the_original_envelope_of_a_body_stored_escaped() -> None:
    # Given an envelope whose text holds a lone surrogate, stored base64 because no database holds it
    env = {"message_id": str(uuid.uuid4()), "type": "OrderPlaced", "payload": {"note": "a\ud800b"}}
    text = json.dumps(env, ensure_ascii=False)
    stored = dead_letters.storable_body(text)
    assert stored.startswith(dead_letters.BODY_B64_PREFIX) and dead_letters.body_of(stored) == text
    row = type("Row", (), {"id": 1, "consumer": "fuzz", "body": stored})()
    # Then replay reads the original envelope back
    assert dead_letters.envelope_of(row) == env
