"""The worker's JSON checks as they were before the third round of issue #24's cuts: the oracles that
tests/unit/test_fast_paths.py compares the cut paths with, and the "full path" bench/check_paths.py times."""

from __future__ import annotations

import json
import re
from typing import Any

from celery_outbox import messages
from celery_outbox.errors import MalformedMessageError

STRING_BEFORE = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.DOTALL)  # messages._JSON_STRING before the cut


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {text[:40]} is out of the float range")
    return value


def decode_json_before(raw: Any, *, max_depth: int, what: str = "message") -> Any:
    """``messages.decode_json`` as it was: ``json.loads`` with hooks (a decoder built per call); with its rules
    of today (a number that overflows to infinity is refused too)."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise MalformedMessageError(f"{what} is not UTF-8: {e}") from None
    elif isinstance(raw, str):
        text = raw
    else:
        raise MalformedMessageError(f"{what} must be JSON text, got {type(raw).__name__}")
    if messages.json_depth_exceeds(text, max_depth):
        raise MalformedMessageError(f"{what} is nested deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:
        raise MalformedMessageError(f"{what} is not JSON: {messages.storable_text(str(e), limit=500)}") from None


def depth_exceeds_before(text: str, max_depth: int) -> bool:
    """``messages.json_depth_exceeds`` before the cut: strings skipped by an alternation per character."""
    if text.count("[") + text.count("{") <= max_depth:
        return False
    depth = 0
    for bracket in re.findall(r"[\[\]{}]", STRING_BEFORE.sub("", text)):
        if bracket in "[{":
            depth += 1
            if depth > max_depth:
                return True
        else:
            depth -= 1
    return False
