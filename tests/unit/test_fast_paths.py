"""The cheap paths of the worker's checks give the full path's answer, for any input (issue #24, third round).

* ``task_rules.check_message`` (the worker's gate) skips ``check_call``'s argument walks (depth, storable
  text) when a scan of the raw body rules out what they look for: same ``TaskCall`` or same error as
  ``decode_body`` + ``check_call``;
* ``messages.decode_json`` decodes with one decoder built at import: same value or same error as
  ``json.loads(text, parse_constant=...)``, which it replaced;
* ``Envelope.from_dict`` does not walk again the depth of a body ``delivery._as_mapping`` decoded from
  text: a consumer delivery's envelope (or error) is the one the walk gives.

Each is compared on hostile text: nesting around every depth bound (brackets inside strings too),
duplicate keys hiding a deep or unstorable value, ``\\u`` escapes of NUL and of lone or paired
surrogates (an escaped backslash before a ``u``), numbers JSON reads as infinite, NaN/Infinity
literals, a BOM, text that is not UTF-8 or not JSON, bodies at the size limit, hostile headers.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any
from unittest import mock

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, example, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from celery_outbox import Settings, messages, task_rules
from celery_outbox.clock import SystemClock
from celery_outbox.consumer import ConsumerSpec
from celery_outbox.delivery import DeliveryContext, _as_mapping, parse_body, parse_envelope
from celery_outbox.errors import MalformedMessageError
from celery_outbox.messages import MalformedDelivery, decode_json
from celery_outbox.schema import define_tables
from celery_outbox.task_rules import TaskRules, check_call, check_message, decode_body
from tests.support.before_cuts import STRING_BEFORE, decode_json_before

MAX_DEPTH = 8
MAX_BYTES = 2048
NAME = "fast.task"
TID = "3f2b8c1e-9a4d-4e2b-8f1a-0c9d7e6b5a43"
HYPO = hsettings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- hostile JSON text, built from fragments (so it may be valid JSON or not) --------------------------------
nasty_char = st.sampled_from(["\x00", "\ud800", "\udfff", "é", "\U0001f600", '"', "\\", "[", "]", "{", "}", "u"])
nasty_text = st.lists(st.one_of(st.characters(), nasty_char), max_size=12).map("".join)
STRING_LITERALS = [
    '"a"', '""', r'"\u0000"', r'"a\u0000b"', r'"\ud800"', r'"\uDFFF"', r'"\uDbFf"', r'"\ud83d\ude00"',
    r'"\\u0000"', r'"\\\u0000"', r'"\u00e9"', r'"\u0041"', r'"\U0000"', r'"\u00"', '"é"', '"[[[{{{"',
    r'"\"[{"', '"\x00"', '"\x1f"', '"a', r'"\"',
]
OTHER_LITERALS = [
    "0", "-1", "1.5", "1e400", "-1E+309", "9" * 330 + ".5", "1e-400", "NaN", "Infinity", "-Infinity",
    "true", "false", "null", "tru", "01", "[", "]", "{", "}", ",", "",
]
string_text = st.one_of(st.sampled_from(STRING_LITERALS), nasty_text.map(json.dumps),
                        nasty_text.map(lambda t: json.dumps(t, ensure_ascii=False)))
scalar_text = st.one_of(string_text, st.sampled_from(OTHER_LITERALS))


def nested_text(depth: int, core: str = "0") -> str:
    return "[" * depth + core + "]" * depth


def _container(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    keys = st.one_of(st.sampled_from(['"k"', '"k"', '"a"']), string_text)  # repeated keys: duplicates
    array = st.lists(inner, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]")
    obj = st.lists(st.tuples(keys, inner), max_size=4).map(
        lambda kv: "{" + ",".join(f"{k}:{v}" for k, v in kv) + "}")
    spaced = st.lists(st.tuples(keys, inner), max_size=3).map(
        lambda kv: "{ " + " , ".join(f"{k} : {v}" for k, v in kv) + " }")
    return st.one_of(array, obj, spaced)


value_text = st.one_of(
    st.recursive(scalar_text, _container, max_leaves=12),
    # nesting around every bound: an argument's (MAX_DEPTH), the body's text bound, the embed's
    st.builds(nested_text, st.integers(MAX_DEPTH - 2, MAX_DEPTH + 12), scalar_text),
    # a deep or unstorable value hidden under a key that a later duplicate replaces
    st.builds(lambda d, v: '{"k":' + nested_text(d) + ',"k":' + v + "}", st.integers(MAX_DEPTH, MAX_DEPTH + 4),
              scalar_text),
    st.builds(lambda bad, v: '{"k":' + bad + ',"k":' + v + "}", st.sampled_from(STRING_LITERALS[2:8]), scalar_text),
    # brackets in strings count in the scan and not in the value
    st.integers(0, 3 * MAX_DEPTH).map(lambda n: '"' + "[" * n + '"'),
)
embed_text = st.one_of(
    st.just("null"), st.just("{}"), st.just('{"callbacks":null,"errbacks":null,"chain":null,"chord":null}'),
    st.builds(lambda v: '{"callbacks":[{"task":"' + NAME + '","args":[' + v + '],"kwargs":{},"options":{}}]}',
              value_text),
    st.builds(lambda v: '{"chain":[' + v + "]}", value_text),
    value_text,
)


@st.composite
def raw_bodies(draw: st.DrawFn) -> bytes:
    """A task message body: mostly ``[args, kwargs, embed]`` of hostile values, sometimes anything."""
    args = "[" + ",".join(draw(st.lists(value_text, max_size=3))) + "]"
    keys = st.sampled_from(['"x"', '"y"'])  # a repeated keyword: a duplicate key
    kwargs = "{" + ",".join(draw(keys) + ":" + v for v in draw(st.lists(value_text, max_size=2))) + "}"
    text: str = draw(st.one_of(
        st.just(f"[{args},{kwargs},{draw(embed_text)}]"),
        st.just(f"[ {args} , {kwargs} , {draw(embed_text)} ]"),
        st.just(f"[{args},{kwargs}]"), st.just(f"[{draw(value_text)},{kwargs},null]"),
        st.just(f"[{args},{draw(value_text)},null]"), value_text,
        # at the size limit, one byte under and over
        st.integers(-2, 1).map(lambda d: '[["' + "a" * (MAX_BYTES - 12 + d) + '"],{},null]'),
    ))
    if draw(st.booleans()):
        text = draw(st.sampled_from(["\ufeff", " ", "\n"])) + text
    raw = text.encode("utf-8", "surrogatepass")  # a lone surrogate stays: not UTF-8, refused
    return raw + b"\xff" if draw(st.integers(0, 19)) == 0 else raw  # sometimes not UTF-8 at all


header_value = st.one_of(st.none(), st.integers(), nasty_text, st.lists(nasty_text, max_size=2),
                         st.dictionaries(nasty_text, nasty_text, max_size=2))
headers_strategy = st.one_of(
    st.just({"task": NAME, "id": TID}),
    st.builds(lambda extra: {"task": NAME, "id": TID, **extra},
              st.dictionaries(st.sampled_from(["x-tenant", "shadow", "retries", "eta", "origin", "argsrepr"]),
                              header_value, max_size=2)),
    st.builds(lambda tid: {"task": NAME, "id": tid}, st.one_of(nasty_text, st.just(TID.upper()))),
)


def _fits(x: Any, y: Any = 1) -> None:
    return None


rules_strategy = st.builds(
    lambda captured, arity: TaskRules(max_depth=MAX_DEPTH, captured=captured, known=lambda n: n == NAME,
                                      arity=arity),
    st.booleans(), st.sampled_from([None, _fits]))


def verdict(check: Any) -> tuple[Any, ...]:
    """What a check said, exactly: the call's fields (repr: types, float spellings, key order) or the error."""
    try:
        call = check()
    except Exception as e:
        return ("refused", type(e).__name__, str(e))
    return ("passed", call.name, call.task_id, repr(call.headers), repr(call.args), repr(call.kwargs),
            repr(call.embed))


def full_path(headers: Any, raw: bytes, rules: TaskRules) -> Any:
    """The gate's check before ``check_message``: decode the body, then walk every argument."""
    body = decode_body(raw, content_type="application/json", content_encoding="utf-8", max_bytes=MAX_BYTES,
                       max_depth=rules.max_depth)
    return check_call(headers, body, rules=rules)


def gate_path(headers: Any, raw: bytes, rules: TaskRules) -> Any:
    return check_message(headers, raw, content_type="application/json", content_encoding="utf-8",
                         max_bytes=MAX_BYTES, rules=rules)


@HYPO
@given(raw=raw_bodies(), headers=headers_strategy, rules=rules_strategy)
@example(raw=b'[["\\u0000"],{},null]', headers={"task": NAME, "id": TID}, rules=TaskRules(max_depth=MAX_DEPTH))
@example(raw=b'[["\\uD800"],{},null]', headers={"task": NAME, "id": TID}, rules=TaskRules(max_depth=MAX_DEPTH))
@example(raw=b'[["ok"],{},null]', headers={"task": NAME, "id": TID, "x": "\x00"}, rules=TaskRules(max_depth=MAX_DEPTH))
@example(raw=("[[" + nested_text(MAX_DEPTH + 1) + "],{},null]").encode(), headers={"task": NAME, "id": TID},
         rules=TaskRules(max_depth=MAX_DEPTH))
@example(raw=("[[],{},{\"chain\":" + nested_text(MAX_DEPTH + 8) + "}]").encode(), headers={"task": NAME, "id": TID},
         rules=TaskRules(max_depth=MAX_DEPTH))
@example(raw=("[[" + nested_text(MAX_DEPTH + 1) + ",[],{}],{},null]").encode(),  # too many brackets to count: scanned
         headers={"task": NAME, "id": TID}, rules=TaskRules(max_depth=MAX_DEPTH))
@example(raw=("[[" + nested_text(MAX_DEPTH) + ',[],{},"[[[["],{},null]').encode(), headers={"task": NAME, "id": TID},
         rules=TaskRules(max_depth=MAX_DEPTH))
def test_the_gate_gives_check_calls_verdict_without_walking_what_its_text_rules_out(
        raw: bytes, headers: dict[str, Any], rules: TaskRules) -> None:
    # Given any raw task message body and headers, hostile or not
    # When the gate checks it, and when the full path (decode, then walk every argument) checks it
    # Then both let the same call through, or both refuse it with the same error
    assert verdict(lambda: gate_path(headers, raw, rules)) == verdict(lambda: full_path(headers, raw, rules))


# Pieces of a JSON string literal around the escapes that matter: NUL, high and low surrogates in both
# cases, escaped backslashes (runs of them), text that looks like an escape without being one.
ESCAPE_ATOMS = [r"\u0000", r"\ud800", r"\uDBFF", r"\udc00", r"\uDFFF", r"\ud83d", r"\ude00", "\\\\", "\\",
                r"\"", r"\u0041", r"\u00e9", "u", "D800", "dc00", "a", "\u00e9", "\U0001f600", r"\n", "0"]


@HYPO
@given(atoms=st.lists(st.sampled_from(ESCAPE_ATOMS), max_size=10))
@example(atoms=[r"\ud800", "\\\\", r"\udc00"])  # a high, an escaped backslash, a low: both lone
@example(atoms=["\\\\", "D800", r"\udc00"])  # "\\D800" then a lone low
@example(atoms=["a", "D800", r"\udc00"])
@example(atoms=["\\\\", "u", "D800", r"\udc00"])  # "\\uD800" (no escape) then a lone low
@example(atoms=["\\\\", r"\u0000"])  # an escaped backslash, then a real NUL escape
def test_the_scan_finds_every_string_that_decodes_unstorable(atoms: list[str]) -> None:
    # Given a JSON string literal built from escapes and backslashes, and its decoded text
    raw = ('["' + "".join(atoms) + '"]').encode("utf-8", "surrogatepass")
    try:
        (text,) = json.loads(raw)
    except ValueError:
        return  # not JSON: the decoder refuses it before any walk
    # When the gate's scan reads it, Then it rules out an unstorable string only when there is none
    assert task_rules._storable_text(raw) is messages.is_storable(text)


def test_a_clean_shallow_body_is_not_walked_but_its_headers_are() -> None:
    # Given a body with few brackets and no escape of NUL or a surrogate (non-ASCII text escaped, as Celery writes it)
    raw = json.dumps([["o-1", [{"sku": "sku-\u00e9", "quantity": 2}]], {"note": "\U0001f600"}, None]).encode()
    rules = TaskRules(max_depth=MAX_DEPTH)
    with mock.patch.object(task_rules, "check_depth") as depth, \
            mock.patch.object(task_rules, "_check_storable", wraps=task_rules._check_storable) as storable:
        # When the gate checks it
        call = gate_path({"task": NAME, "id": TID}, raw, rules)
    # Then no argument was walked, the headers were, and the call is the body's
    assert depth.call_count == 0
    assert [c.kwargs["what"] for c in storable.call_args_list] == ["headers"]
    assert call.args == ["o-1", [{"sku": "sku-\u00e9", "quantity": 2}]] and call.kwargs == {"note": "\U0001f600"}


@pytest.mark.parametrize("raw", [
    pytest.param(b'[["a\\u0000"],{},null]', id="NUL escape"),
    pytest.param(b'[[],{"k":"\\udc00"},null]', id="lone surrogate escape in a keyword argument"),
    pytest.param(b'[[{"\\uD800":1}],{},null]', id="lone surrogate escape in a key"),
])
def test_an_escape_of_an_unstorable_character_is_still_refused(raw: bytes) -> None:
    # Given a body that writes NUL or a lone surrogate as a \u escape
    # When the gate checks it, Then it is refused as the full path refuses it
    with pytest.raises(MalformedMessageError, match="NUL character or a lone surrogate"):
        gate_path({"task": NAME, "id": TID}, raw, TaskRules(max_depth=MAX_DEPTH))


def test_an_argument_one_level_too_deep_is_still_refused() -> None:
    # Given a body with the fewest brackets an argument one level too deep needs (one over what the scan rules out)
    raw = ("[[" + nested_text(MAX_DEPTH + 1) + "],{},null]").encode()
    # When the gate checks it, Then the argument is walked and refused
    with pytest.raises(MalformedMessageError, match="argument 1 is nested deeper than 8 levels"):
        gate_path({"task": NAME, "id": TID}, raw, TaskRules(max_depth=MAX_DEPTH))


# -- the depth scan of JSON text: strings skipped by an unrolled pattern ------------------------------------
def text_depth(text: str) -> int:
    """How deep ``text`` nests outside its strings, one character at a time (a backslash escapes the next)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


scan_text = st.one_of(
    value_text, raw_bodies().map(lambda b: b.decode("utf-8", "surrogateescape")),
    st.lists(st.sampled_from(['"', "\\", "\\\\", '\\"', "[", "]", "{", "}", "a", "\n", "é"]), max_size=40).map("".join),
)


@HYPO
@given(text=scan_text, max_depth=st.integers(0, MAX_DEPTH + 12))
@example(text='"a\\', max_depth=0)  # an unclosed string ending in a backslash
@example(text='["\\"[",[[', max_depth=1)
@example(text='["\\\n[",0]', max_depth=1)  # an escaped line break (not JSON; the scan must still skip it)
def test_the_depth_scan_skips_strings_as_before(text: str, max_depth: int) -> None:
    # Given any text, JSON or not (unclosed strings, stray backslashes, brackets in strings)
    # When its strings are cut out now and as before, Then what is left is the same text
    assert messages._JSON_STRING.sub("", text) == STRING_BEFORE.sub("", text)
    # And the depth verdict is the one a character-by-character reading gives
    assert messages.json_depth_exceeds(text, max_depth) is (text_depth(text) > max_depth)


# -- decode_json: one decoder built at import ----------------------------------------------------------------
def outcome(decode: Any) -> tuple[str, str]:
    try:
        return "value", repr(decode())
    except Exception as e:
        return type(e).__name__, str(e)


@HYPO
@given(text=st.one_of(value_text, raw_bodies()), prefix=st.sampled_from(["", "\ufeff", " \ufeff", "\ufeff\ufeff"]),
       as_bytes=st.booleans(), max_depth=st.integers(1, MAX_DEPTH + 4))
@example(text="{}", prefix="\ufeff", as_bytes=False, max_depth=4)
@example(text=nested_text(2000), prefix="", as_bytes=False, max_depth=3000)
def test_decode_json_gives_json_loads_verdict(text: Any, prefix: str, as_bytes: bool, max_depth: int) -> None:
    # Given any text (or its bytes), a BOM before it or not
    raw: str | bytes
    if isinstance(text, bytes):  # maybe not UTF-8
        raw = prefix.encode() + text if as_bytes else prefix + text.decode("utf-8", "surrogateescape")
    else:
        raw = (prefix + text).encode("utf-8", "surrogatepass") if as_bytes else prefix + text
    # When it is decoded now and the way it was, Then both give the same value or the same error
    assert outcome(lambda: decode_json(raw, max_depth=max_depth, what="body")) == \
        outcome(lambda: decode_json_before(raw, max_depth=max_depth, what="body"))


def test_decode_json_builds_no_decoder_per_call() -> None:
    # Given no decoder can be built any more
    with mock.patch.object(json, "JSONDecoder", side_effect=AssertionError("a decoder built per call")):
        # When JSON is decoded, Then the one built at import does it (NaN still refused)
        assert decode_json('{"a":[1,2.5,"\\u00e9"]}') == {"a": [1, 2.5, "\u00e9"]}
        with pytest.raises(MalformedMessageError, match="NaN is not JSON"):
            decode_json('{"a":NaN}')


# -- Envelope.from_dict: a consumer delivery's body is measured once --------------------------------------
SETTINGS = Settings(max_json_depth=MAX_DEPTH, max_message_bytes=16 * 1024)


class AnyType(ConsumerSpec):
    """A consumer of every event type: the envelope's checks alone decide."""

    def accepts(self, event_type: str) -> bool:
        return True


SPEC = AnyType(name="fast", events=frozenset({"OrderPlaced"}), handler=lambda session, envelope: None)
TABLES = define_tables(sa.MetaData())
MID = "6f1c1b9e-2b7a-4c44-9a0e-6a1f2f3e4d5c"


@st.composite
def envelope_bodies(draw: st.DrawFn) -> Any:
    """A delivered body: envelope text with a hostile payload or headers, the same decoded as a dict, or junk."""
    payload = draw(st.one_of(value_text, value_text.map(json.dumps)))  # a payload sent as a JSON string too
    headers = draw(st.one_of(st.just("{}"), value_text))
    key = draw(st.sampled_from(["payload", "payload", "headers"]))  # a duplicate key may replace a deep one
    text = ('{"message_id":"' + MID + '","type":"OrderPlaced","payload":' + payload + ',"headers":' + headers
            + ',"created_at_ms":1' + draw(st.one_of(st.just(""), st.just(f',"{key}":0'))) + "}")
    body: Any = draw(st.one_of(st.just(text), st.just("\ufeff" + text), value_text))
    if draw(st.integers(0, 3)) == 0:  # the body as a mapping (an eager call): never measured, always walked
        with contextlib.suppress(ValueError):
            body = json.loads(body)
    return body


def parsed(body: Any, wrapper_levels: int, *, walk: bool) -> Any:
    """``deliver``'s envelope of ``body`` (``walk``: as before, the decoded mapping walked again)."""
    malformed = MalformedDelivery.decode(body) if isinstance(body, str) else None
    mapping = _as_mapping(body, malformed, SETTINGS.max_json_depth)
    if walk:
        return messages.Envelope.from_dict(mapping if mapping is not None else body,
                                           max_depth=SETTINGS.max_json_depth + wrapper_levels)
    context = DeliveryContext.build(SPEC, tables=TABLES, settings=SETTINGS, clock=SystemClock(),
                                    wrapper_levels=wrapper_levels)
    return parse_envelope(context, parse_body(body, max_depth=SETTINGS.max_json_depth), True)


@HYPO
@given(body=envelope_bodies(), wrapper_levels=st.integers(0, 2))
@example(body={"message_id": MID, "type": "OrderPlaced", "payload": json.loads(nested_text(MAX_DEPTH + 1))},
         wrapper_levels=0)
@example(body='{"message_id":"' + MID + '","type":"OrderPlaced","payload":' + nested_text(MAX_DEPTH) + "}",
         wrapper_levels=1)
def test_a_delivered_envelope_is_the_one_the_second_walk_gave(body: Any, wrapper_levels: int) -> None:
    # Given any delivered body (text or mapping, hostile or not) and any wrapper depth (consumer or idempotent task)
    # When the delivery validates it, and when it validated it walking the decoded body again
    # Then both give the same envelope or the same error
    assert outcome(lambda: parsed(body, wrapper_levels, walk=False)) == \
        outcome(lambda: parsed(body, wrapper_levels, walk=True))


def test_an_envelope_decoded_from_text_is_not_walked_again() -> None:
    # Given a consumer delivery's envelope text, as the strategy hands it to the pool
    text = json.dumps({"message_id": MID, "type": "OrderPlaced", "payload": {"lines": [{"sku": "a"}]}})
    with mock.patch.object(messages, "check_depth", wraps=messages.check_depth) as walk:
        # When the delivery validates it, Then its depth was measured once (on the text), never walked
        envelope = parsed(text, 0, walk=False)
        assert walk.call_count == 0
        # And a body given as a mapping is walked
        parsed(json.loads(text), 0, walk=False)
        assert walk.call_count == 1
    assert str(envelope.message_id) == MID and envelope.payload == {"lines": [{"sku": "a"}]}


def test_a_decoded_body_is_walked_when_its_bound_was_looser() -> None:
    # Given a value decoded under a looser bound than the one it must meet
    value = {"message_id": MID, "type": "OrderPlaced", "payload": json.loads(nested_text(MAX_DEPTH))}
    # When it is validated, Then it is walked and refused
    with pytest.raises(MalformedMessageError, match="nested deeper"):
        messages.Envelope.from_dict(value, max_depth=MAX_DEPTH, decoded_within=MAX_DEPTH + 2)
