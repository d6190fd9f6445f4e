"""Review of the gate's text scans (issue #24): whole JSON documents, not one string at a time.

``tests/unit/test_fast_paths.py`` builds a single string literal from escape atoms, or bodies from a fixed
list of literals. Here any JSON value (keys, nested strings, NUL, lone and paired surrogates written as
escapes by ``json.dumps``, raw non-ASCII text) is dumped, and the scans are compared with what decoding it
gives: ``_storable_text`` with the walk of every string and key, ``json_depth_exceeds`` with the value's depth.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, example, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from celery_outbox import messages, task_rules
from celery_outbox.errors import MalformedMessageError

HYPO = hsettings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Text around the code points that matter: NUL, both halves of a surrogate pair (alone, paired, reversed),
# an astral character (json.dumps writes it as a pair of escapes), backslashes, quotes and the letter u.
atom = st.sampled_from(["\x00", "\ud800", "\udbff", "\udc00", "\udfff", "\U0001f600", "\\", '"', "u", "D800",
                        "a", "\u00e9", "["])
text = st.one_of(st.lists(atom, max_size=8).map("".join), st.text(max_size=6))
values = st.recursive(
    st.one_of(text, st.integers(), st.none(), st.booleans()),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
    max_leaves=16)


def unstorable_by_walk(value: Any) -> bool:
    try:
        task_rules._check_storable(value, what="value")
    except MalformedMessageError:
        return True
    return False


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


@HYPO
@given(value=values, ascii_only=st.booleans())
@example(value=["\ud800", "\udc00"], ascii_only=True)  # the halves of a pair in two strings: both lone
@example(value={"\ud800": "\udc00"}, ascii_only=True)  # in a key and its value
@example(value=["\ud800\udc00"], ascii_only=True)  # two code units json.dumps writes as a pair: one character
@example(value=["\\\ud800", "\udc00\\"], ascii_only=True)
def test_the_storable_scan_agrees_with_the_walk_of_the_decoded_document(value: Any, ascii_only: bool) -> None:
    # Given any JSON document, its strings written as escapes (ensure_ascii) or as raw UTF-8 where they can be
    raw_text = json.dumps(value, ensure_ascii=ascii_only)
    try:
        raw = raw_text.encode("utf-8")
    except UnicodeEncodeError:
        return  # a lone surrogate written raw is not UTF-8: the decoder refuses it before any scan
    decoded = json.loads(raw)
    # When the gate's scan reads the text, Then it rules out an unstorable string exactly when the walk of
    # the decoded document finds none
    assert task_rules._storable_text(raw) is not unstorable_by_walk(decoded)


@HYPO
@given(value=values, bound=st.integers(0, 6), spaced=st.booleans())
def test_the_depth_scan_agrees_with_the_decoded_documents_depth(value: Any, bound: int, spaced: bool) -> None:
    # Given any JSON document (strings full of brackets, quotes and backslashes)
    raw_text = json.dumps(value, indent=1 if spaced else None)
    # When its nesting is scanned, Then the verdict is the decoded value's
    assert messages.json_depth_exceeds(raw_text, bound) is (depth(json.loads(raw_text)) > bound)
