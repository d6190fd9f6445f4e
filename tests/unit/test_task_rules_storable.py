"""The storable-text rule (no NUL, no lone surrogate) sees through subclasses of the JSON types.

``task_rules._check_storable`` dispatches the exact JSON types on ``type()`` for speed; a value of a
subclass (a ``str`` subclass, an ``OrderedDict``, a ``UserDict``, a named tuple) must still be walked
and judged as before, at both doors (``check_call`` is the one rule table).
"""

from __future__ import annotations

from collections import OrderedDict, UserDict, namedtuple
from typing import Any

import pytest

from celery_outbox.errors import MalformedMessageError
from celery_outbox.task_rules import TaskRules, check_call

RULES = TaskRules(max_depth=16)
TID = "3f2b8c1e-9a4d-4e2b-8f1a-0c9d7e6b5a43"
Pair = namedtuple("Pair", "left right")  # a plain tuple subclass is the point


class Text(str):
    pass


def headers(**extra: Any) -> dict[str, Any]:
    return {"task": "rules.add", "id": TID, **extra}


HIDDEN = [
    pytest.param(Text("a\x00b"), id="str subclass"),
    pytest.param(OrderedDict([("k", "a\x00b")]), id="OrderedDict value"),
    pytest.param(OrderedDict([(Text("k\ud800"), 1)]), id="OrderedDict key, str subclass"),
    pytest.param(UserDict({"k": ["x", "\udfff"]}), id="UserDict (a Mapping, not a dict)"),
    pytest.param(Pair("ok", ["a\x00"]), id="named tuple"),
    pytest.param([1, 2.5, True, None, {"deep": (Text("\x00"),)}], id="scalars then a tuple of a subclass"),
]


@pytest.mark.parametrize("value", HIDDEN)
def test_unstorable_text_inside_a_subclass_is_refused_in_arguments(value: Any) -> None:
    # Given an argument whose NUL or lone surrogate sits inside a subclass of a JSON type
    # When the rule table checks the call, Then it is refused, naming the text
    with pytest.raises(MalformedMessageError, match="NUL character or a lone surrogate"):
        check_call(headers(), [[value], {}, None], rules=RULES)


@pytest.mark.parametrize("value", HIDDEN)
def test_unstorable_text_inside_a_subclass_is_refused_in_headers(value: Any) -> None:
    # Given a header holding the same value, When the rule table checks it, Then it is refused too
    with pytest.raises(MalformedMessageError, match="NUL character or a lone surrogate"):
        check_call(headers(custom=value), [[1], {}, None], rules=RULES)


def test_storable_subclasses_pass() -> None:
    # Given the same shapes with storable text only, When checked, Then the call passes
    value = [Text("a"), OrderedDict([("k", "v")]), UserDict({"k": 1}), Pair("x", [1.5, None, False])]
    call = check_call(headers(custom=value), [value, {}, None], rules=RULES)
    assert call.task_id == TID


@pytest.mark.parametrize("value", [{1: "a"}, {1: "a", "1": "b"}, {None: 1}, {1.5: 1}, {True: 1}, [{"ok": {(1, 2): 1}}],
                                   OrderedDict([(2, "x")])])
def test_an_object_key_that_is_not_text_is_refused_not_rewritten(value: Any) -> None:
    # Given an argument or header holding an object key JSON would write as text ({1: "a"} arrives as {"1": "a"};
    # {1: "a", "1": "b"} as one of the two)
    # When the rule table checks the call; Then it is refused, saying so, instead of arriving changed
    with pytest.raises(MalformedMessageError, match="object key that is not text"):
        check_call(headers(), [[value], {}, None], rules=RULES)
    with pytest.raises(MalformedMessageError, match="object key that is not text"):
        check_call(headers(custom=value), [[1], {}, None], rules=RULES)
