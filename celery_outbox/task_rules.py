"""The one rule table of a Celery task message the outbox carries: enqueue refuses what the worker dead-letters.

Two doors see a task message: ``task.delay()`` inside a transaction (``celery/enqueue.py``, which
refuses with a ``ValidationError`` before anything is written) and the worker's gate in front of
Celery's own unpacking (``celery/gate.py``, which turns the message into a dead letter with its raw
bytes). Both call ``check_call`` (the worker calls ``decode_body`` first, for the bytes), so a message
the gate would dead-letter can never be enqueued, and one that enqueue accepts always runs
(tests/unit/test_task_rules.py feeds the same hostile cases to both doors).

Two strengths, chosen by ``TaskRules.captured``:

* a task the outbox captures or defines (``@outbox.task``, a plain ``@app.task`` sent through the
  outbox): every rule below;
* any other task of the app (Celery's built-ins, the library's own periodic tasks, names in
  ``OUTBOX_ENQUEUE_EXCLUDE``): only what keeps the worker alive and the message from being dropped
  with a log line (shape, types, readable ETA/expiry/time limits, a task id), since Celery sends
  those itself (chords, non-UUID ids) and the outbox never stores them.

The rules of a captured task, each a ``MalformedMessageError`` saying what is wrong:

* the task name: 1-200 printable characters, no NUL or lone surrogate (it is the row's ``type``);
* the task id: a UUID; any spelling ``uuid.UUID`` reads (upper case, no dashes, braces,
  ``urn:uuid:``) is normalised to the canonical lower-case dashed form, at enqueue and at the worker;
* ``[args, kwargs, embed]``: a list, an object, and ``null`` or an object with only ``callbacks``,
  ``errbacks``, ``chain`` and ``chord``; no chord (its counter lives in the result backend);
* every argument nested at most ``max_json_depth`` levels (``OUTBOX_MAX_JSON_DEPTH``; the check is
  iterative, so 5,000 levels is a clear refusal, not a ``RecursionError``), the arguments of every
  embedded callback, errback and chain step too (each runs as a message of its own);
* no NUL and no lone surrogate in any string or key of the arguments, the embedded signatures or
  the headers (no database column stores them); an unusable trace header (``tracing.TRACE_HEADERS``) is
  not refused but left out of the message (tracing is optional metadata; ``TaskCall.dropped_trace_headers``);
* every task an embedded callback, errback or chain step names is one ``known`` accepts (a task of
  this app that the outbox captures), never a library task or a consumer's;
* the arguments fit the task's signature (Celery's own ``__header__`` check), when the task is known;
* headers: ``eta``/``expires`` ISO-8601 text or null, ``timelimit`` two positive numbers or nulls,
  ``retries`` an integer 0..1,000,000, ``shadow`` at most 200 characters, text headers text.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_outbox.errors import MalformedMessageError as Bad
from celery_outbox.messages import (
    TYPE_MAX_CHARS,
    check_depth,
    decode_json,
    is_storable,
    json_depth_exceeds,
    storable_text,
)
from celery_outbox.tracing import unusable_trace_headers

CONTENT_TYPE = "application/json"
CONTENT_ENCODINGS = ("utf-8", "utf8")
EMBED_KEYS = ("callbacks", "errbacks", "chain", "chord")
MAX_RETRIES_HEADER = 1_000_000
ID_MAX_CHARS = 255  # the longest task id string read at all (``urn:uuid:`` and braces fit easily)
# An embed holds signatures whose arguments may themselves nest ``max_depth`` levels: chain list,
# signature object, its args, its options' links... this much room above an argument's own bound.
EMBED_EXTRA_DEPTH = 8
# The body [args, kwargs, embed] and the embed add levels above any one argument.
BODY_EXTRA_DEPTH = EMBED_EXTRA_DEPTH + 2
_TEXT_HEADERS = ("lang", "origin", "argsrepr", "kwargsrepr", "group", "root_id", "parent_id", "shadow")
_SIGNATURE_KEYS = frozenset({"task", "args", "kwargs", "options"})

Known = Callable[[str], bool]
Arity = Callable[..., Any]


def _never(name: str) -> bool:
    return False


@dataclass(frozen=True, kw_only=True)
class TaskRules:
    """What a door knows when it checks one message.

    ``known`` says whether an embedded callback may name a task; ``arity`` is the task's Celery
    ``__header__`` (None when the task is not known here: no signature to check against)."""

    max_depth: int
    captured: bool = True
    known: Known = field(default=_never)
    arity: Arity | None = None


@dataclass(frozen=True, kw_only=True)
class TaskCall:
    """A task message that passed: its headers (ids normalised), and its body, ready for Celery."""

    name: str
    task_id: str
    headers: dict[str, Any]
    args: list[Any]
    kwargs: dict[str, Any]
    embed: dict[str, Any] | None
    dropped_trace_headers: tuple[str, ...] = ()  # unusable trace headers left out of ``headers``

    @property
    def body(self) -> list[Any]:
        return [self.args, self.kwargs, self.embed]


def canonical_task_id(value: Any) -> str:
    """The canonical lower-case dashed spelling of a UUID task id; anything else is refused."""
    if not isinstance(value, str) or not value or len(value) > ID_MAX_CHARS:
        raise Bad(f"task id must be a UUID (through the outbox it is the message id), got {_short(value)}")
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise Bad(f"task id must be a UUID (through the outbox it is the message id), got {_short(value)}") from None


def _maybe_canonical(value: Any) -> Any:
    """A UUID-looking header (root_id, parent_id) in the canonical spelling; anything else unchanged."""
    if isinstance(value, str) and len(value) <= ID_MAX_CHARS:
        try:
            return str(uuid.UUID(value))
        except ValueError:
            return value
    return value


def check_name(value: Any, *, captured: bool = True) -> str:
    if not isinstance(value, str) or not value:
        raise Bad(f"the task header must name a task, got {_short(value)}")
    if len(value) > TYPE_MAX_CHARS or (captured and not (value.isprintable() and is_storable(value))):
        raise Bad(f"task name must be 1-{TYPE_MAX_CHARS} printable characters without NUL or lone surrogates, "
                  f"got {_short(value)}")
    return value


def decode_body(raw: bytes, *, content_type: Any, content_encoding: Any, max_bytes: int, max_depth: int) -> Any:
    """The worker's half: the raw broker body as JSON, or ``MalformedMessageError`` saying why not."""
    if not isinstance(content_type, str) or content_type.lower() != CONTENT_TYPE:
        raise Bad(f"content type must be {CONTENT_TYPE}, got {_short(content_type)}")
    if not isinstance(content_encoding, str) or content_encoding.lower() not in CONTENT_ENCODINGS:
        raise Bad(f"content encoding must be utf-8, got {_short(content_encoding)}")
    if len(raw) > max_bytes:
        raise Bad(f"message body is {len(raw)} bytes, over the limit of {max_bytes} bytes")
    return decode_json(raw, max_depth=max_depth + BODY_EXTRA_DEPTH, what="message body")


# A JSON string can hold NUL or a lone surrogate only through a \u escape: strict decoding refuses a raw
# control character in a string, and strict UTF-8 refuses an encoded surrogate. Once every escaped
# backslash is blanked out (``_storable_text``), every \u left is an escape, and the decoder joins a high
# surrogate's escape with a low one's right after it into one character; the scan finds an escape of NUL,
# a high one no low one follows, a low one no high one precedes: what can decode to an unstorable string.
_UNSTORABLE_ESCAPE = re.compile(
    rb"\\u0000"
    rb"|\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F]")
# Of the brackets ``[args, kwargs, embed]`` opens, these three hold no argument's own levels: the body's
# array, the args array and the kwargs object (``check_call`` has seen all three before it walks).
_TRIPLE_BRACKETS = 3
# Levels above any argument: the body's array, and the args array or the kwargs object. The embed is one
# level down and may nest ``EMBED_EXTRA_DEPTH`` more than an argument: what bounds an argument bounds it.
_ARGUMENT_LEVELS = 2


def check_message(headers: Any, raw: bytes, *, content_type: Any, content_encoding: Any, max_bytes: int,
                  rules: TaskRules) -> TaskCall:
    """The worker's door: ``decode_body`` then ``check_call``, on the raw body as it came.

    The argument walks of ``check_call`` (depth, storable text) look for what a cheap scan of the raw
    text can rule out. An argument cannot nest deeper than the body opens arrays and objects (less the
    three of the triple), nor deeper than the text nests (less the two levels above it; the text's
    nesting bounds the value's: a duplicate key can only drop levels), and cannot hold NUL or a lone
    surrogate when no escape writes one (``_storable_text``). What the scan rules out is not walked;
    anything else is walked as before, so the verdict and the error are ``check_call``'s
    (tests/unit/test_fast_paths.py compares them)."""
    body = decode_body(raw, content_type=content_type, content_encoding=content_encoding, max_bytes=max_bytes,
                       max_depth=rules.max_depth)
    # The body decoded: ``raw`` is strict UTF-8 JSON, whose brackets outside strings the depth scan counts exactly.
    shallow = (raw.count(b"[") + raw.count(b"{") <= rules.max_depth + _TRIPLE_BRACKETS
               or not json_depth_exceeds(raw.decode("utf-8"), rules.max_depth + _ARGUMENT_LEVELS))
    storable = _storable_text(raw)
    return _check_call(headers, body, rules=rules, shallow=shallow, storable=storable)


def _storable_text(raw: bytes) -> bool:
    """True when no string of the JSON text ``raw`` decodes to NUL or a lone surrogate (``_UNSTORABLE_ESCAPE``).

    Only said of text that decodes: a backslash outside a string is not JSON. Blanking ``\\\\`` pairs left
    to right follows the decoder's escapes (each backslash escapes the next character); blanking (not
    removing) them keeps an escape before them from meeting one after them."""
    if b"\\u" not in raw:
        return True
    return _UNSTORABLE_ESCAPE.search(raw.replace(b"\\\\", b"..")) is None


def check_call(headers: Any, body: Any, *, rules: TaskRules) -> TaskCall:
    """Check one task message (headers as Celery builds them, body as ``[args, kwargs, embed]``).

    Returns it with its ids normalised; raises ``MalformedMessageError`` naming the first rule broken."""
    return _check_call(headers, body, rules=rules, shallow=False, storable=False)


def _check_call(headers: Any, body: Any, *, rules: TaskRules, shallow: bool, storable: bool) -> TaskCall:
    """``check_call``; ``shallow``/``storable``: the body's text proves no argument breaks that rule (not walked)."""
    if not isinstance(headers, Mapping):
        raise Bad(f"headers must be a mapping, got {type(headers).__name__}")
    dropped = unusable_trace_headers(headers)
    if dropped:  # optional metadata: left out, never a reason to refuse (tracing.py)
        headers = {k: v for k, v in headers.items() if k not in dropped}
    name = check_name(headers.get("task"), captured=rules.captured)
    raw_id = headers.get("id")
    if rules.captured:
        task_id = canonical_task_id(raw_id)
    elif isinstance(raw_id, str) and raw_id and len(raw_id) <= ID_MAX_CHARS:
        task_id = raw_id
    else:
        raise Bad(f"task id must be a non-empty string, got {_short(raw_id)}")
    if not (isinstance(body, (list, tuple)) and len(body) == 3):
        raise Bad("message body must be the protocol 2 triple [args, kwargs, embed]")
    args, kwargs, embed = body
    if not isinstance(args, (list, tuple)):
        raise Bad(f"args must be a list, got {type(args).__name__}")
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise Bad(f"kwargs must be an object with text keys, got {type(kwargs).__name__}")
    if embed is not None and not isinstance(embed, Mapping):
        raise Bad(f"embed must be an object or null, got {type(embed).__name__}")
    if not shallow:
        for i, arg in enumerate(args):
            check_depth(arg, max_depth=rules.max_depth, what=f"argument {i + 1}")
        for key, arg in kwargs.items():
            check_depth(arg, max_depth=rules.max_depth, what=f"keyword argument {storable_text(key, limit=60)!r}")
        if embed is not None:
            check_depth(embed, max_depth=rules.max_depth + EMBED_EXTRA_DEPTH, what="embedded signatures")
    out_headers = _check_headers(headers, task_id=task_id, rules=rules)
    if rules.captured:
        if not storable:
            _check_storable((list(args), dict(kwargs), embed), what="arguments")
        _check_storable(dict(headers), what="headers")
        _check_embed(embed, rules.known, max_depth=None if shallow else rules.max_depth)
        if rules.arity is not None:
            try:
                rules.arity(*args, **kwargs)
            except TypeError as e:
                raise Bad(f"arguments do not fit task {name}: {storable_text(str(e), limit=300)}") from None
    return TaskCall(name=name, task_id=task_id, headers=out_headers, args=list(args), kwargs=dict(kwargs),
                    embed=None if embed is None else dict(embed), dropped_trace_headers=dropped)


def _check_headers(headers: Mapping[str, Any], *, task_id: str, rules: TaskRules) -> dict[str, Any]:
    out = dict(headers)
    out["id"] = task_id
    for key in ("root_id", "parent_id"):
        out[key] = _maybe_canonical(out.get(key))
    for key in _TEXT_HEADERS:
        value = out.get(key)
        if value is not None and not isinstance(value, str):
            raise Bad(f"header {key} must be text or null, got {type(value).__name__}")
    shadow = out.get("shadow")
    if isinstance(shadow, str) and len(shadow) > TYPE_MAX_CHARS:
        raise Bad(f"header shadow is over {TYPE_MAX_CHARS} characters")
    for key in ("eta", "expires"):
        _check_time(key, out.get(key))
    retries = out.get("retries", 0)
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int)
                                or not 0 <= retries <= MAX_RETRIES_HEADER):
        raise Bad(f"header retries must be an integer 0..{MAX_RETRIES_HEADER}, got {_short(retries)}")
    limits = out.get("timelimit")
    if limits is not None and not (isinstance(limits, (list, tuple)) and len(limits) == 2
            and all(v is None or _positive(v) for v in limits)):
        raise Bad(f"header timelimit must be [hard, soft] seconds > 0 or nulls, got {_short(limits)}")
    ignore = out.get("ignore_result")
    if ignore is not None and not isinstance(ignore, bool):
        raise Bad("header ignore_result must be true, false or null")
    return out


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _check_time(key: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str) or len(value) > 64:
        raise Bad(f"header {key} must be an ISO-8601 date and time or null, got {_short(value)}")
    try:
        when = dt.datetime.fromisoformat(value)
        if when.tzinfo is not None:
            when.astimezone(dt.UTC)
    except (ValueError, OverflowError):
        raise Bad(f"header {key} {_short(value)} is not an ISO-8601 date and time") from None


_SCALARS = frozenset({int, float, bool, type(None)})
_EXACT = _SCALARS | {str, dict, list, tuple}  # exact JSON types: never a subclass of another branch's type


def _check_storable(value: Any, *, what: str) -> None:
    """No NUL, no lone surrogate in any string or key, and every key text (iterative; depth is bounded by the caller).

    The exact JSON types are dispatched on ``type()`` first: both doors run this on every message, and
    ``isinstance(x, Mapping)`` (an ABC check) on every scalar was half its cost. Subclasses take the
    ``isinstance`` branches, so the verdict (and the item an error names) is the same."""
    stack = [value]
    pop, extend = stack.pop, stack.extend
    while stack:
        item = pop()
        kind = type(item)
        if kind is str or (kind not in _EXACT and isinstance(item, str)):
            if not is_storable(item):
                raise Bad(f"{what} hold a NUL character or a lone surrogate, which no database column stores: "
                          f"{storable_text(item, limit=60)!r}")
        elif kind in _SCALARS:
            continue
        elif kind is dict or (kind not in _EXACT and isinstance(item, Mapping)):
            for key in item:
                if type(key) is not str and not isinstance(key, str):
                    # JSON writes the key as text: {1: "a"} would arrive as {"1": "a"}, and {1: .., "1": ..} as one
                    raise Bad(f"{what} hold an object key that is not text ({type(key).__name__} "
                              f"{storable_text(repr(key), limit=40)}): JSON would change it")
                if not is_storable(key):
                    raise Bad(f"{what} hold a NUL character or a lone surrogate, which no database column stores: "
                              f"{storable_text(key, limit=60)!r}")
            extend(item.values())
        elif kind is list or kind is tuple or (kind not in _EXACT and isinstance(item, (list, tuple))):
            extend(item)


def _check_embed(embed: Mapping[str, Any] | None, known: Known, *, max_depth: int | None) -> None:
    """The embed's shape and the tasks it names; with ``max_depth``, every embedded signature's arguments are
    bounded as the message's own are (a callback, errback or chain step runs as a task message of its own:
    one too deep would pass here and be dead-lettered after the parent ran). ``max_depth`` None: the body's
    text already proves no argument in it nests that deep (``check_message``)."""
    if embed is None:
        return
    unknown = sorted(str(k) for k in embed if k not in EMBED_KEYS)
    if unknown:
        raise Bad(f"embed holds unknown key(s) {storable_text(', '.join(unknown), limit=120)}")
    if embed.get("chord"):
        raise Bad("a chord cannot go through the outbox (its counter lives in the result backend)")
    for key in ("callbacks", "errbacks", "chain"):
        value = embed.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(s, Mapping) for s in value)):
            raise Bad(f"embed {key} must be a list of signatures or null")
    stack: list[Any] = [embed.get(k) for k in ("callbacks", "errbacks", "chain")]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            if set(item) >= _SIGNATURE_KEYS or "subtask_type" in item:
                task = item.get("task")
                if not isinstance(task, str) or not known(task):
                    raise Bad(f"embed names task {_short(task)}, which is not a task of this app the outbox carries")
                if max_depth is not None:
                    _check_signature_depth(item, task, max_depth)
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _check_signature_depth(signature: Mapping[str, Any], task: str, max_depth: int) -> None:
    args, kwargs = signature.get("args"), signature.get("kwargs")
    who = f"embedded task {storable_text(task, limit=120)!r}"
    if isinstance(args, (list, tuple)):
        for i, arg in enumerate(args):
            check_depth(arg, max_depth=max_depth, what=f"{who} argument {i + 1}")
    if isinstance(kwargs, Mapping):
        for key, arg in kwargs.items():
            check_depth(arg, max_depth=max_depth, what=f"{who} keyword argument {storable_text(str(key), limit=60)!r}")


def _short(value: Any) -> str:
    """A bounded, storable description of an untrusted value for an error message."""
    text = repr(value) if isinstance(value, (str, int, float, bool)) or value is None else f"a {type(value).__name__}"
    return storable_text(text, limit=120)
