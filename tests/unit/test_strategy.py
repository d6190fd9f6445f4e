"""The worker parent's readers of a raw body hand the pool what a full decode + re-encode would have.

``strategy.canonical_message`` takes the envelope text of a body framed exactly as the relay writes it
out of the raw text (``_relay_envelope``) instead of decoding the whole body and encoding the envelope
again; ``gate.Gate.check`` hands the pool the raw body it checked instead of re-encoding the decoded
arguments. Both are compared here, for any content, with the full path they replace. The gate wraps no
consumer task, plain or batch: each checks its own messages.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import pytest
from celery import Celery
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from kombu.serialization import loads as pool_loads
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Outbox, Settings
from celery_outbox.celery import strategy
from celery_outbox.celery.gate import Gate
from celery_outbox.celery.strategy import CanonicalMessage, canonical_message, stable_task_id
from celery_outbox.errors import OutboxError
from celery_outbox.messages import (
    TASK_ID_NAMESPACE,
    MalformedDelivery,
    celery_task_message,
    check_size,
    decode_json,
    encode_json,
    task_name,
)
from consumers.testing import order_placed_envelope

TASK = task_name("fuzz")
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
SETTINGS = Settings(max_json_depth=8, max_message_bytes=16 * 1024)
TAIL = "],{}," + encode_json(dict(strategy.EMBED)) + "]"  # the relay's frame (messages.celery_task_messages)

nasty_char = st.sampled_from(["\x00", "\ud800", "\udfff", "é", '"', "\\", "[", "]", "{", "}", ",", ":"])
nasty_text = st.lists(st.one_of(st.characters(), nasty_char), max_size=30).map("".join)
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), nasty_text)
json_value = st.recursive(json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(nasty_text, inner, max_size=3)), max_leaves=15)
HYPO = hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@dataclass
class Wire:
    """What kombu hands the worker's parent."""

    body: bytes | str
    headers: Any
    content_type: Any = "application/json"
    content_encoding: Any = "utf-8"
    delivery_info: Any = field(default_factory=lambda: {"exchange": "x", "routing_key": "x.fuzz"})
    properties: Any = field(default_factory=dict)


def canonical(message: Wire, *, full_path: bool = False) -> CanonicalMessage:
    """The strategy's answer; ``full_path``: as before ``_relay_envelope`` (decode all, encode the envelope)."""
    with mock.patch.object(strategy, "_relay_envelope", return_value=None) if full_path else nullcontext():
        return canonical_message(message, task_name=TASK, settings=SETTINGS, route=("x", "x.fuzz"), max_eta_s=60.0,
                                 now=NOW)


def framed_bodies() -> st.SearchStrategy[bytes]:
    """Bodies in the relay's exact frame: any envelope text inside, valid JSON or not, deep or not."""
    inner = st.one_of(
        json_value.map(lambda v: json.dumps(v, separators=(",", ":"), sort_keys=True)),
        st.dictionaries(nasty_text, json_value, max_size=4).map(lambda d: json.dumps(d, sort_keys=True)),
        st.dictionaries(nasty_text, json_value, max_size=4).map(json.dumps),  # keys unsorted, with spaces
        nasty_text,
        st.integers(1, 40).map(lambda n: '{"k":' + "[" * n + "]" * n + "}"),
        st.just('{"a":1}],{},{"b":2'),  # a frame inside the frame
        st.just('{"a":1} '), st.just("{}"), st.just("{"),
        # numbers JSON reads as an infinite float (which no encoder writes back)
        st.sampled_from(['{"a":1e400}', '{"a":-1E+0309}', '{"a":' + "9" * 320 + ".5}", '{"a":1e99,"b":"e400"}']),
        # near the size limit, with text its re-encoding makes longer (\u escapes, 1e15 -> 1000000000000000.0)
        st.integers(1000, 9000).map(lambda n: '{"a":"' + "é" * n + '"}'),
        st.integers(100, 2000).map(lambda n: '{"a":[' + ",".join(["1e15"] * n) + "]}"),
    )
    text = inner.map(lambda t: "[[" + t + TAIL if t.startswith("{") else "[[{" + t + TAIL)
    return text.map(lambda t: t.encode("utf-8", "surrogatepass"))


def test_a_relay_message_hands_over_its_envelope_text_as_the_relay_wrote_it() -> None:
    # Given a consumer message exactly as the relay publishes it
    msg = celery_task_message(order_placed_envelope("o-1"), consumer="fuzz", routing_key="x.fuzz")
    wire = Wire(body=msg.body.encode(), headers=dict(msg.headers), properties=dict(msg.properties))
    # When the strategy builds the message Celery sees
    fast, full = canonical(wire), canonical(wire, full_path=True)
    # Then its one argument is the envelope text of the body, the same text the full path encodes
    (arg,), _, _ = json.loads(fast.body)
    assert msg.body == "[[" + arg + TAIL
    assert fast.body == full.body and fast.headers == full.headers and fast.properties == full.properties


@HYPO
@given(body=framed_bodies(), as_text=st.booleans())
def test_a_framed_body_gives_the_pool_the_same_envelope_as_the_full_decode(body: bytes, as_text: bool) -> None:
    # Given any body in the relay's frame (as bytes, or as text the way py-amqp may hand it over)
    wire = Wire(body=body.decode("utf-8", "surrogateescape") if as_text else body,
                headers={"task": TASK, "id": str(uuid.uuid4()), "retries": 0})
    # When the strategy reads it, and when the full path (decode all, encode the envelope) reads it
    fast, full = canonical(wire), canonical(wire, full_path=True)
    # Then Celery sees the same headers and a well-formed body either way
    assert fast.headers == full.headers and fast.delivery_info == full.delivery_info
    (fast_arg,), kwargs, embed = json.loads(fast.body)
    (full_arg,), _, _ = json.loads(full.body)
    assert kwargs == {} and not any(embed.values())
    if MalformedDelivery.decode(full_arg) is not None:
        # And a body the full path finds malformed is malformed with the same reason and raw bytes
        assert fast_arg == full_arg
    else:
        # And a well-formed one hands the pool the same envelope value, which fits the size limit or not alike
        assert decode_json(fast_arg, max_depth=SETTINGS.max_json_depth) == decode_json(
            full_arg, max_depth=SETTINGS.max_json_depth)
        assert fits(fast_arg) is fits(full_arg)


@HYPO
@given(arg=nasty_text)
def test_the_canonical_body_is_the_encoders_text_of_the_triple(arg: str) -> None:
    # Given any one argument (NUL, lone surrogates, quotes, backslashes, any character)
    # Then the body written around its escaped text is the JSON encoder's text of [[arg], {}, no callbacks]
    encoder = json.JSONEncoder(separators=(",", ":"))
    assert strategy.single_argument_body(arg) == encoder.encode([[arg], {}, dict(strategy.EMBED)])


def fits(arg: str) -> bool:
    """The pool's size verdict on a delivered envelope text (``delivery.parse_envelope``)."""
    try:
        check_size(arg, limit=SETTINGS.max_message_bytes)
    except OutboxError:
        return False
    return True


# -- the gate -------------------------------------------------------------------------------------------
NAME = "strategy.any"


@pytest.fixture
def gate_app(sqlite_sessions: sessionmaker[Session]) -> tuple[Gate, Any]:
    app = Celery("strategy-gate", set_as_current=False)
    outbox = Outbox(app, session_factory=sqlite_sessions, settings=SETTINGS)

    @app.task(name=NAME, shared=False)  # type: ignore[untyped-decorator]
    def any_args(*args: Any, **kwargs: Any) -> None:
        return None

    app.finalize()
    return Gate(outbox), any_args


@HYPO
@given(args=st.lists(json_value, max_size=3), kwargs=st.dictionaries(nasty_text, json_value, max_size=2),
       typed=st.booleans(), spaced=st.booleans())
def test_the_gate_gives_the_pool_the_raw_body_which_decodes_as_the_re_encoded_one(
        gate_app: tuple[Gate, Any], args: list[Any], kwargs: dict[str, Any], typed: bool, spaced: bool) -> None:
    gate, task = gate_app
    if typed:  # an argument kombu's JSON type hooks turn into bytes in the pool
        args = [*args, {"__type__": "bytes", "__value__": "aGk="}]
    # Given any task message on the wire, compact or spaced
    headers, properties, body, _ = gate.app.amqp.create_task_message(str(uuid.uuid4()), NAME, args, kwargs)
    raw = json.dumps(body, separators=(", ", ": ") if spaced else (",", ":")).encode("utf-8", "surrogatepass")
    # When the gate lets it through
    try:
        checked = gate.check(Wire(body=raw, headers=headers, properties=properties), None, NAME, gate.rules_for(task))
    except OutboxError:
        return  # refused messages are dead-lettered: tests/hostile/test_task_poison.py
    # Then the pool receives the raw body, and decodes it to what the re-encoded arguments decoded to
    assert checked.body is raw
    before = json.dumps(checked.payload, separators=(",", ":"))
    assert pool_loads(checked.body, checked.content_type, checked.content_encoding, accept={"application/json"}) == \
        pool_loads(before, checked.content_type, checked.content_encoding, accept={"application/json"})



def test_the_gate_leaves_plain_and_batch_consumer_tasks_to_their_own_strategy(
        sqlite_sessions: sessionmaker[Session]) -> None:
    # Given an app with a consumer, a batch consumer and a plain task, and the strategies Celery made for them
    app = Celery("strategy-gate-consumers", set_as_current=False)
    outbox = Outbox(app, session_factory=sqlite_sessions, settings=SETTINGS)

    @outbox.consumer("OrderPlaced", name="one")
    def one(session: Session, envelope: Any) -> None:
        return None

    @outbox.consumer("OrderPlaced", name="many", batch_size=10)
    def many(session: Session, envelopes: list[Any]) -> None:
        return None

    @app.task(name=NAME, shared=False)  # type: ignore[untyped-decorator]
    def any_args(*args: Any, **kwargs: Any) -> None:
        return None

    app.finalize()
    celerys: dict[str, Any] = {name: (lambda *a: None) for name in app.tasks}  # one function each
    worker = mock.Mock(strategies=dict(celerys), task_consumer=None)
    # When the gate installs itself on the worker's consumer
    Gate(outbox).install(worker)
    # Then each consumer task keeps its own strategy (it checks its messages and dead-letters under its consumer),
    # and every other task is gated
    assert worker.strategies[task_name("one")] is celerys[task_name("one")]
    assert worker.strategies[task_name("many")] is celerys[task_name("many")]
    assert worker.strategies[NAME] is not celerys[NAME]
    assert worker.strategies[NAME].__wrapped__ is celerys[NAME]

def parsed_task_id(value: Any, raw: bytes) -> str:
    """The task id as the strategy derived it by parsing every id (before canonical ids were kept as they are)."""
    if isinstance(value, str) and len(value) <= 64:
        try:
            return str(uuid.UUID(value))
        except ValueError:
            pass
    return str(uuid.uuid5(TASK_ID_NAMESPACE, "raw:" + raw.hex()))


@given(value=st.one_of(st.uuids().map(str), st.uuids().map(lambda u: str(u).upper()), st.uuids().map(lambda u: u.hex),
                       st.uuids().map(lambda u: "{" + str(u) + "}"), st.uuids().map(lambda u: f"urn:uuid:{u}"),
                       st.uuids().map(lambda u: str(u) + "\n"), nasty_text, st.integers(), st.none()),
       raw=st.binary(max_size=20))
def test_a_task_id_is_the_one_parsing_it_gives(value: Any, raw: bytes) -> None:
    # Given any task id header (canonical, another UUID spelling, or not a UUID) and any body
    # Then the strategy's task id is the one parsing it as a UUID gives (else derived from the body)
    assert stable_task_id(value, raw) == parsed_task_id(value, raw)
