"""One rule table, two doors: the same hostile task messages get the same verdict at ``.delay()`` and at the worker.

The enqueue door is the real capture (``outbox.transaction`` + ``apply_async``/``send_task``); the
worker door is the real gate (``celery.gate.Gate.check``) fed the bytes Celery would have put on the
wire for that call. A verdict is "refused" or the task id the message runs under (normalised).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import pytest
import sqlalchemy as sa
from celery import Celery, signature
from celery.exceptions import Reject, Retry
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import ManualClock, Outbox, Settings, Tables, ValidationError
from celery_outbox.celery import gate as gate_mod
from celery_outbox.celery.gate import Gate
from celery_outbox.errors import DatabaseError, OutboxError, SerializationError
from celery_outbox.messages import MalformedDelivery
from celery_outbox.task_rules import TaskRules, canonical_task_id, check_call

MAX_DEPTH = 8
NAME = "rules.add"


@dataclass
class Call:
    label: str
    args: list[Any] = field(default_factory=lambda: [1])
    kwargs: dict[str, Any] = field(default_factory=dict)
    task_id: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    raw: bytes | None = None  # the body on the wire when json.dumps cannot write it (too deep for its recursion)
    refused: bool = True


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def deep_body(depth: int) -> bytes:
    return b"[[" + b"[" * depth + b"0" + b"]" * depth + b"],{},null]"


U = "3f2b8c1e-9a4d-4e2b-8f1a-0c9d7e6b5a43"
CALLS = [
    Call("a plain call", refused=False),
    Call("keyword arguments", args=[1], kwargs={"y": 2}, refused=False),
    Call("an argument nested exactly to the limit", args=[nested(MAX_DEPTH)], refused=False),
    Call("an argument nested one level too deep", args=[nested(MAX_DEPTH + 1)]),
    Call("999 levels (RecursionError before)", args=[nested(999)], raw=deep_body(999)),
    Call("5,000 levels", args=[nested(5000)], raw=deep_body(5000)),
    Call("NUL in an argument", args=["a\x00b"]),
    Call("lone surrogate in an argument", args=["\ud800"]),
    Call("NUL in a keyword name", args=[1], kwargs={"y\x00": 1}),
    Call("NUL in a header", options={"headers": {"x-tenant": "a\x00"}}),
    Call("lone surrogate in a header", options={"headers": {"x-tenant": "\udfff"}}),
    Call("upper-case task id", task_id=U.upper(), refused=False),
    Call("task id without dashes", task_id=U.replace("-", ""), refused=False),
    Call("task id in braces", task_id="{" + U + "}", refused=False),
    Call("urn:uuid: task id", task_id="urn:uuid:" + U, refused=False),
    Call("task id not a UUID", task_id="invoice-42"),
    Call("wrong arity", args=[1, 2, 3]),
    Call("unknown keyword", args=[1], kwargs={"z": 1}),
    Call("callback to a task of this app", options={"link": signature(NAME, args=(1,))}, refused=False),
    Call("callback to a library task", options={"link": signature("celery_outbox.poison")}),
    Call("callback to Celery's own task", options={"link": signature("celery.backend_cleanup")}),
    Call("errback to an unknown task", options={"link_error": signature("nobody.knows")}),
    Call("a callback nested exactly to the limit", options={"link": signature(NAME, args=(nested(MAX_DEPTH),))},
         refused=False),
    Call("a callback's argument nested one level too deep",
         options={"link": signature(NAME, args=(nested(MAX_DEPTH + 1),))}),
    Call("an errback's keyword argument nested one level too deep",
         options={"link_error": signature(NAME, kwargs={"y": nested(MAX_DEPTH + 1)})}),
    Call("a chain step's argument nested one level too deep",
         options={"chain": [dict(signature(NAME, args=(nested(MAX_DEPTH + 1),)))]}),
    Call("a number that overflows to infinity (1e400)", args=[float("inf")], raw=b"[[1e400],{},null]"),
    Call("NUL in traceparent (dropped, not refused)", options={"headers": {"traceparent": "00-\x00"}}, refused=False),
    Call("lone surrogate in traceparent (dropped, not refused)", options={"headers": {"traceparent": "00-\ud800"}},
         refused=False),
    Call("NUL in tracestate (dropped, not refused)", options={"headers": {"tracestate": "k=\x00"}}, refused=False),
    Call("a countdown", options={"countdown": 30}, refused=False),
    Call("a shadow name over 200 characters", options={"shadow": "s" * 201}),
]


class App:
    def __init__(self, sessions: sessionmaker[Session], tables: Tables) -> None:
        self.sessions = sessions
        self.app = Celery("rules", broker="memory://localhost/rules", set_as_current=False)
        self.app.conf.update(task_routes={NAME: {"queue": "rules"}})
        self.outbox = Outbox(self.app, session_factory=sessions, clock=ManualClock(start_ms=1_000),
                             settings=Settings(max_json_depth=MAX_DEPTH))
        self.outbox._tables = tables
        self.tables = tables

        @self.app.task(name=NAME, shared=False)  # type: ignore[untyped-decorator]
        def add(x: Any, y: Any = 0) -> Any:
            return x

        self.task = add
        self.app.finalize()

    def enqueue(self, call: Call) -> str:
        """The enqueue door's verdict: the row's task id, or "refused" (and then nothing is written)."""
        with self.sessions() as s:
            try:
                with self.outbox.transaction(s):
                    self.app.send_task(NAME, args=call.args, kwargs=call.kwargs, task_id=call.task_id, **call.options)
                s.commit()
            except (ValidationError, SerializationError):  # a rule broken, or not JSON (NaN, infinity) at all
                s.rollback()
                return "refused"
            row = s.execute(sa.select(self.tables.outbox).order_by(self.tables.outbox.seq.desc())).scalars().first()
            assert row is not None
            s.execute(sa.delete(self.tables.outbox))
            s.commit()
        assert str(row.message_id) == row.headers["task_headers"]["id"]
        return str(row.message_id)

    def worker(self, call: Call) -> str:
        """The gate's verdict for the message Celery builds for this call, as its bytes on the wire."""
        tid = call.task_id or str(uuid.uuid4())
        options = dict(call.options)
        extra_headers = options.pop("headers", {})
        link, link_error = options.pop("link", None), options.pop("link_error", None)
        headers, properties, body, _ = self.app.amqp.create_task_message(
            tid, NAME, call.args, call.kwargs, callbacks=[link] if link else None,
            errbacks=[link_error] if link_error else None, **options)
        headers.update(extra_headers)
        raw = call.raw if call.raw is not None else json.dumps(body).encode()
        message = WireMessage(headers=headers, body=raw, properties=properties)
        gate = Gate(self.outbox)
        try:
            canonical = gate.check(message, None, NAME, gate.rules_for(self.task))
        except OutboxError:
            return "refused"
        return str(canonical.headers["id"])


@dataclass
class WireMessage:
    """What kombu hands the worker: headers, the raw body, its content type and encoding."""

    headers: dict[str, Any]
    body: bytes
    properties: dict[str, Any]
    content_type: str = "application/json"
    content_encoding: str = "utf-8"
    delivery_info: dict[str, Any] = field(default_factory=lambda: {"exchange": "", "routing_key": "rules"})


@pytest.fixture
def rules_app(any_sessions: sessionmaker[Session], tables: Tables) -> Iterator[App]:
    yield App(any_sessions, tables)


@pytest.mark.parametrize("call", CALLS, ids=[c.label for c in CALLS])
def test_enqueue_and_the_worker_give_the_same_verdict(rules_app: App, call: Call) -> None:
    # Given one task call, hostile or not
    # When it meets the enqueue door and, as Celery's bytes on the wire, the worker's gate
    at_enqueue = rules_app.enqueue(call)
    at_worker = rules_app.worker(call)
    # Then both refuse it, or both run it under the same canonical task id
    assert at_enqueue == at_worker or (not call.task_id and "refused" not in (at_enqueue, at_worker))
    assert (at_enqueue == "refused") is call.refused, at_enqueue
    if call.task_id and not call.refused:
        assert at_enqueue == at_worker == U


def test_canonical_task_id_reads_every_uuid_spelling_and_nothing_else() -> None:
    for spelling in (U, U.upper(), U.replace("-", ""), "{" + U + "}", "urn:uuid:" + U):
        assert canonical_task_id(spelling) == U
    for bad in ("", "invoice-42", U + "0", None, 42, "x" * 1000):
        with pytest.raises(OutboxError, match="task id must be a UUID"):
            canonical_task_id(bad)


def test_tasks_the_outbox_does_not_carry_get_only_the_rules_that_keep_the_worker_alive() -> None:
    # Given a Celery built-in's message with a non-UUID id, a chord and NUL in an argument (Celery sends such)
    headers = {"task": "celery.chord_unlock", "id": "not-a-uuid"}
    body = [["a\x00"], {}, {"chord": {"task": "x"}, "callbacks": None, "errbacks": None, "chain": None}]
    # When it is checked as a task the outbox does not capture, Then it passes
    assert check_call(headers, body, rules=TaskRules(max_depth=4, captured=False)).task_id == "not-a-uuid"
    # But a shape Celery would crash or drop on is refused whatever the task
    for bad_headers, bad_body in ((headers, {"a": 1}), (headers, [[], [], None]), ({**headers, "eta": "soon"}, body),
                                  ({**headers, "timelimit": [0, "x"]}, body), ({**headers, "retries": -1}, body)):
        with pytest.raises(OutboxError):
            check_call(bad_headers, bad_body, rules=TaskRules(max_depth=4, captured=False))


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_the_gate_drops_an_unusable_trace_header_counts_it_and_logs_it_once(
        rules_app: App, caplog: pytest.LogCaptureFixture) -> None:
    # Given task messages whose trace headers hold a NUL, a lone surrogate, or are not text, and a good one
    gate = Gate(rules_app.outbox)
    bad = [{"traceparent": "00-\x00"}, {"traceparent": "\udc00", "tracestate": "a=1"}, {"tracestate": "k=\x00"},
           {"baggage": {"k": "v"}}]
    canonical = []
    with caplog.at_level("WARNING", logger="celery_outbox.tracing"):
        for extra in [*bad, {"traceparent": TRACEPARENT}]:
            headers, properties, body, _ = rules_app.app.amqp.create_task_message(str(uuid.uuid4()), NAME, [1], {})
            headers.update(extra)
            message = WireMessage(headers=headers, body=json.dumps(body).encode(), properties=properties)
            # When the worker's gate checks each
            canonical.append(gate.check(message, None, NAME, gate.rules_for(rules_app.task)))
    # Then each runs: the unusable trace header is left out, the rest of the headers kept, a good one kept
    assert [sorted(k for k in c.headers if k in ("traceparent", "tracestate", "baggage")) for c in canonical] == [
        [], ["tracestate"], [], [], ["traceparent"]]
    assert canonical[-1].headers["traceparent"] == TRACEPARENT
    # And the drops are counted, the first one logged, the others not
    assert gate.trace_headers_dropped.count == 4
    assert [r.getMessage().count("dropped unusable trace header") for r in caplog.records] == [1]


def malformed_wire(rules_app: App, raw: bytes) -> WireMessage:
    headers, properties, _, _ = rules_app.app.amqp.create_task_message(str(uuid.uuid4()), NAME, [1], {})
    return WireMessage(headers=headers, body=raw, properties=properties)


@pytest.mark.parametrize("size", [300 * 1024, 2 * 1024 * 1024])
def test_a_large_malformed_task_body_is_handed_to_the_poison_task_whole(rules_app: App, size: int) -> None:
    # Given a task message body over max_message_bytes (256 KiB), malformed (a NUL escape in its argument)
    raw = b'[["' + b"x" * size + b'\\u0000"],{},null]'
    assert len(raw) > rules_app.outbox.settings.max_message_bytes
    gate = Gate(rules_app.outbox)
    # When the gate hands it to the poison task
    canonical = gate.poison_message(malformed_wire(rules_app, raw), "headers hold a NUL character")
    (text,), _, _ = canonical.payload
    delivery = MalformedDelivery.decode(text)
    # Then the dead letter it writes keeps every byte (a replay sends what was received), and says nothing was cut
    assert delivery is not None and delivery.body == raw and "cut" not in delivery.error


def test_a_poison_delivery_too_large_to_retry_goes_back_to_the_broker_while_the_database_is_down(
        rules_app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a malformed delivery too large to travel again as a retry message, and a database that is down
    gate = Gate(rules_app.outbox)
    raw = b'[["' + b"x" * (400 * 1024) + b'"],{},null]'
    (text,), _, _ = gate.poison_message(malformed_wire(rules_app, raw), "over the limit").payload
    assert len(text) > gate_mod.poison_retry_limit(rules_app.outbox.settings)

    def down(*args: Any, **kwargs: Any) -> bool:
        raise DatabaseError("connection refused")

    pauses: list[float] = []
    monkeypatch.setattr(gate_mod, "record_poison", down)
    monkeypatch.setattr(time, "sleep", pauses.append)
    retried = mock.patch.object(rules_app.app.tasks[gate_mod.POISON_TASK], "retry",
                                side_effect=AssertionError("re-sent as a retry message"))
    # When the poison task runs, Then it rejects the original message back to the broker (whole), not a cut retry
    with retried, pytest.raises(Reject) as e:
        rules_app.app.tasks[gate_mod.POISON_TASK](text)
    assert e.value.requeue is True and len(pauses) == 1


def test_a_small_poison_delivery_still_retries_while_the_database_is_down(
        rules_app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(rules_app.outbox)
    (text,), _, _ = gate.poison_message(malformed_wire(rules_app, b'{"a":1}'), "not a list").payload

    def down(*args: Any, **kwargs: Any) -> bool:
        raise DatabaseError("connection refused")

    monkeypatch.setattr(gate_mod, "record_poison", down)
    task = rules_app.app.tasks[gate_mod.POISON_TASK]
    with mock.patch.object(task, "retry", side_effect=Retry("retrying")) as retry, pytest.raises(Retry):
        task(text)
    assert retry.call_count == 1
