"""The worker's checks of a message, per call, before and after the third round of issue #24's cuts.

Each piece runs its full path (the code before the cut, which is still the library's own path for what a
cut cannot prove) and its cut path on the same input, in the same process, interleaved, in microseconds
of CPU per call (the minimum over ``--repeats`` timings of ``--calls`` calls each):

* ``gate``: ``Gate.check`` of a plain ``@app.task`` message captured through the outbox, in the worker's
  main process; full path: ``task_rules.decode_body`` + ``check_call`` (every argument walked for depth
  and storable text, strings skipped by the depth scan's pattern before the cut), cut:
  ``task_rules.check_message`` (walks the raw text rules out are skipped). Four bodies: ``order``
  (``bench/worker_parent.py``'s: ASCII), ``order_emoji`` (non-ASCII text and an emoji, which Celery's JSON
  writes as ``\\u`` escapes and a surrogate pair), ``order_40_lines`` (40 line objects: few enough
  brackets), ``order_100_lines`` (100: more brackets than the depth bound, so the text's depth is scanned
  twice, by ``decode_json`` and by the gate, where the walk ran before);
* ``decode_json``: ``messages.decode_json`` of an envelope's text; full path: ``json.loads`` with a hook
  (a decoder built per call), cut: one decoder built at import;
* ``depth_scan_100_lines``: ``messages.json_depth_exceeds`` of the 100-line body (what ``decode_json`` and
  the gate run on a body with more brackets than the depth bound); full path: strings skipped by the
  pattern before the cut, cut: the unrolled pattern;
* ``envelope``: what a consumer delivery does with its body in the pool, ``delivery.parse_body`` then
  ``delivery.parse_envelope``; full path: the decoded mapping walked again for depth (``Envelope.from_dict``
  without ``decoded_within``), cut: not walked again. Both include ``decode_json``'s cut; the cut path's
  ``parse_body`` also reads what the delivery reads once for all its steps (the malformed-delivery marker, the
  body's type and headers, one ``Body``), which the full path leaves out.

Prints each piece's figures and after/before ratio; writes bench/results/check_paths.json.

    .venv/bin/python bench/check_paths.py [--calls 2000] [--repeats 15]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery import Celery

from bench._common import write_result
from celery_outbox import Outbox, Settings, messages, task_rules
from celery_outbox.celery import gate as gate_module
from celery_outbox.celery.gate import Gate
from celery_outbox.clock import SystemClock
from celery_outbox.consumer import ConsumerSpec
from celery_outbox.delivery import DeliveryContext, _as_mapping, parse_body, parse_envelope
from celery_outbox.messages import Envelope, celery_task_message
from consumers.testing import order_placed_envelope
from tests.support.before_cuts import STRING_BEFORE, decode_json_before, depth_exceeds_before


class Message:
    """The attributes of a kombu message the gate reads."""

    def __init__(self, body: bytes, headers: dict[str, Any], properties: dict[str, Any]) -> None:
        self.body = body
        self.headers = headers
        self.properties = properties
        self.content_type = "application/json"
        self.content_encoding = "utf-8"
        self.delivery_info = {"exchange": "", "routing_key": "cp.relay", "redelivered": False}


def cpu_us(fn: Callable[[], Any], calls: int) -> float:
    t = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t) * 1e6 / calls


def full_check_message(headers: Any, raw: bytes, *, content_type: Any, content_encoding: Any, max_bytes: int,
                       rules: task_rules.TaskRules) -> task_rules.TaskCall:
    """The gate's check before the cut: decode, then ``check_call`` walking every argument."""
    body = task_rules.decode_body(raw, content_type=content_type, content_encoding=content_encoding,
                                  max_bytes=max_bytes, max_depth=rules.max_depth)
    return task_rules.check_call(headers, body, rules=rules)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="check-paths-")
    settings = Settings(database_url=f"sqlite:///{home}/db.sqlite3", broker_url="memory://", namespace="cp")
    app = Celery("check-paths", set_as_current=False)
    outbox = Outbox(app, settings=settings)

    @app.task(name="bench.plain", ignore_result=True)  # type: ignore[untyped-decorator]
    def plain(order_id: str, lines: list[dict[str, Any]], note: str = "") -> None:
        return None

    gate = Gate(outbox)
    rules = gate.rules_for(plain)
    env = order_placed_envelope("o-1")
    lines = env.payload["lines"]
    bodies = {
        "order": (["o-1", lines], {}),
        "order_emoji": (["o-1", [{**line, "name": "Café crème"} for line in lines]], {"note": "merci \U0001f600"}),
        "order_40_lines": (["o-1", [{**lines[0], "sku": f"sku-{i}"} for i in range(40)]], {}),
        "order_100_lines": (["o-1", [{**lines[0], "sku": f"sku-{i}"} for i in range(100)]], {}),
    }
    # name -> (before, after, what the before path runs under: the cut undone)
    pieces: dict[str, tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any]]] = {}
    for label, (call_args, call_kwargs) in bodies.items():
        tid = str(uuid.uuid4())
        task_msg = app.amqp.as_task_v2(tid, "bench.plain", args=call_args, kwargs=call_kwargs)
        message = Message(json.dumps(list(task_msg.body)).encode(), {**task_msg.headers}, dict(task_msg.properties))

        def check(message: Message = message) -> Any:
            return gate.check(message, None, "bench.plain", rules)

        @contextlib.contextmanager
        def full_gate() -> Any:
            with mock.patch.object(gate_module, "check_message", full_check_message), \
                    mock.patch.object(messages, "_JSON_STRING", STRING_BEFORE):
                yield

        with full_gate():
            before_payload = repr(check().payload)
        assert repr(check().payload) == before_payload
        pieces[f"gate_{label}"] = (check, check, full_gate)

    # The envelope text the pool receives: what the strategy cuts out of the relay's frame (``_relay_envelope``).
    envelope_text = messages.encode_json(env.to_dict())
    assert celery_task_message(env, consumer="shipping", routing_key="cp.shipping").body.startswith("[[" + envelope_text)
    depth = settings.max_json_depth
    pieces["decode_json"] = (lambda: decode_json_before(envelope_text, max_depth=depth),
                             lambda: messages.decode_json(envelope_text, max_depth=depth), contextlib.nullcontext)
    spec = ConsumerSpec(name="shipping", events=frozenset({"OrderPlaced"}), handler=lambda session, envelope: None)

    context = DeliveryContext.build(spec, tables=outbox.tables, settings=settings, clock=SystemClock())

    def delivery_envelope() -> Envelope:
        return parse_envelope(context, parse_body(envelope_text, max_depth=depth), True)

    def delivery_envelope_before() -> Envelope:
        """``parse_envelope`` before the cut (a gated body): the decoded mapping walked again by ``from_dict``."""
        mapping = _as_mapping(envelope_text, None, depth)
        envelope = Envelope.from_dict(mapping if mapping is not None else envelope_text, max_depth=depth)
        if not spec.accepts(envelope.type):
            raise AssertionError("accepted")
        return envelope

    assert delivery_envelope() == delivery_envelope_before()
    big = json.dumps(list(app.amqp.as_task_v2(str(uuid.uuid4()), "bench.plain", args=bodies["order_100_lines"][0],
                                               kwargs={}).body))
    assert depth_exceeds_before(big, depth) is messages.json_depth_exceeds(big, depth)
    pieces["depth_scan_100_lines"] = (lambda: depth_exceeds_before(big, depth),
                                      lambda: messages.json_depth_exceeds(big, depth), contextlib.nullcontext)
    pieces["envelope"] = (delivery_envelope_before, delivery_envelope, contextlib.nullcontext)

    timings: dict[str, dict[str, list[float]]] = {k: {"before": [], "after": []} for k in pieces}
    for r in range(args.repeats + 1):  # repeat 0 warms up
        for name, (before_fn, after_fn, undone) in pieces.items():
            with undone():
                b = cpu_us(before_fn, args.calls)
            a = cpu_us(after_fn, args.calls)
            if r:
                timings[name]["before"].append(b)
                timings[name]["after"].append(a)
    print(f"\nmicroseconds of CPU per call, min of {args.repeats} repeats of {args.calls} calls:")
    summary: dict[str, dict[str, float]] = {}
    for name, t in timings.items():
        before_us, after_us = min(t["before"]), min(t["after"])
        summary[name] = {"before_us": before_us, "after_us": after_us, "ratio": after_us / before_us}
        print(f"  {name:22} before {before_us:7.2f}  after {after_us:7.2f}  after/before {after_us / before_us:.2f}")
    write_result("check_paths", {"calls": args.calls, "repeats": args.repeats, "min_us": summary, "timings": timings})


if __name__ == "__main__":
    main()
