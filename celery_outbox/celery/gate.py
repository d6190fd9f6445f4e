"""The worker's gate for every task message that is not a consumer's: none crashes, stalls or vanishes.

Consumer tasks check their own messages (``strategy.guarded``, their ``Task.Strategy``, in front of a
batch consumer's buffer too: ``batch_tasks.batching``), so the gate leaves them alone
(``CONSUMER_STRATEGIES``). Every other task of the app (``@outbox.task`` tasks, plain ``@app.task``
tasks the outbox captures, the library's own periodic tasks, Celery's built-ins) and every message
that names no task at all goes through this gate: a consumer bootstep (``GateStep``) that runs after
Celery's ``Tasks`` step (it fills ``consumer.strategies``, on every connection restart too) and

* wraps each task's strategy: the raw body is checked (``task_rules.decode_body``) and the message
  against the one rule table enqueue applies too (``task_rules.check_call``, through
  ``task_rules.check_message``, which skips the walks its raw text rules out) *before* Celery
  unpacks anything; a message that passes reaches Celery's own strategy rebuilt from the checked
  values (headers with ids normalised, the arguments as decoded here, never through kombu's JSON type
  hooks) and its raw body for the pool (the same text, so not encoded again);
* replaces the consumer's ``on_unknown_task``, ``on_unknown_message``, ``on_invalid_task`` and
  ``on_decode_error`` (Celery's would log the message and drop it), the task consumer's too.

Whatever fails, the message is handed, as a canonical message built from scratch, to ONE library
task, ``celery_outbox.poison`` (``POISON_TASK``), with a ``messages.MalformedDelivery`` (raw bytes
kept whole, however large: a replay sends exactly what was received; the reason, sanitised headers)
as its one argument. That task runs in the pool under the consumer time limits: it writes the dead
letter (the consumer dead-letter store, under the task's key ``task:<name>``, so ``outbox
dead-letters replay`` re-sends a well-formed one as that task with its task id), sends
``outbox-dead-lettered``, and rejects the message; if the database is down it retries with the
consumer backoff, so an outage costs a redelivery, never the message. A retry is a message of its own
and must pass this gate's size check, so a delivery too large for that (``poison_retry_limit``) is not
re-sent: after a pause of the first backoff step the original message is rejected back to the broker
(``Reject(requeue=True)``), which delivers it again whole. Nothing here
touches the database in the worker's main process, and the gate never raises into Celery's loop:
the worker stays alive whatever the bytes, and no message loops (a poison message is dead-lettered
on its first delivery; its own message is checked like any other, and a bad one is dead-lettered
directly, never re-sent).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from celery import bootsteps
from celery.exceptions import Reject
from vine import promise

from celery_outbox import tracing
from celery_outbox.celery import batch_tasks, delayed_retry, events
from celery_outbox.celery.config import consumer_time_limits
from celery_outbox.celery.consumer_tasks import DeadLettered
from celery_outbox.celery.enqueue import OWN_PREFIXES, carried, own_task_names
from celery_outbox.celery.strategy import (
    EMBED,
    STRATEGY,
    CanonicalMessage,
    body_limit,
    malformed_text,
    mapping_attr,
    raw_bytes,
    single_argument_body,
    stable_task_id,
)
from celery_outbox.db import wrap_driver_errors
from celery_outbox.errors import DatabaseError, MalformedMessageError, OutboxError
from celery_outbox.inbox import dead_letters
from celery_outbox.inbox.task_keys import task_key
from celery_outbox.messages import TYPE_MAX_CHARS, MalformedDelivery, storable_text
from celery_outbox.policy import RetryPolicy
from celery_outbox.task_rules import TaskRules, canonical_task_id, check_message

log = logging.getLogger(__name__)

POISON_TASK = "celery_outbox.poison"
UNNAMED = "(no task name)"  # the dead letter's task of a message that names none
_GATED = "_celery_outbox_gated"
# The strategies of consumer tasks, plain and batch: each checks its own messages (a malformed one is counted and
# dead-lettered under its consumer), so the gate does not wrap them.
CONSUMER_STRATEGIES = frozenset({STRATEGY, batch_tasks.STRATEGY})


def register(outbox: Any) -> Any:
    """Define ``celery_outbox.poison`` on ``outbox.app`` and add the gate to its worker consumer."""
    app = outbox.app
    task = define_poison_task(outbox)
    gate = Gate(outbox)

    class GateStep(bootsteps.StartStopStep):
        """Wraps the consumer's strategies and unknown/invalid hooks once the Tasks step filled them."""

        requires = ("celery.worker.consumer.tasks:Tasks",)  # type: ignore[assignment]

        def start(self, parent: Any) -> None:
            gate.install(parent)

    app.steps["consumer"].add(GateStep)
    return task


class Gate:
    """What the bootstep installs on a worker consumer (module docstring)."""

    def __init__(self, outbox: Any) -> None:
        self.outbox = outbox
        self.app = outbox.app
        self.settings = outbox.settings
        self.trace_headers_dropped = tracing.DroppedTraceHeaders(where="the worker's task gate")

    def rules_for(self, task: Any) -> TaskRules:
        """The rule table's view of ``task`` from this worker (``task_rules`` says what each strength means)."""
        name = task.name
        captured = not (name.startswith(OWN_PREFIXES) or name in self.settings.enqueue_exclude
                        or name in own_task_names(self.outbox))
        return TaskRules(max_depth=self.settings.max_json_depth, captured=captured,
                         known=lambda callback: carried(self.outbox, callback),
                         arity=getattr(task, "__header__", None) if captured and task.typing else None)

    def install(self, consumer: Any) -> None:
        strategies = consumer.strategies
        poison = strategies.get(POISON_TASK)
        if poison is None:  # pragma: no cover - register() defines it on the app
            log.error("outbox: %s is not registered; the worker's task gate is off", POISON_TASK)
            return
        poison = getattr(poison, "__wrapped__", poison)

        def to_poison(message: Any, error: str, ack: Any = None, reject: Any = None) -> None:
            """Hand ``message`` to the poison task; never raises into Celery's loop."""
            try:
                if ack is None:
                    ack = promise(consumer.call_soon_ack, (message.ack_log_error,))
                    reject = promise(consumer.call_soon_ack, (message.reject_log_error,))
                poison(self.poison_message(message, error), None, ack, reject, consumer.on_task_message)
            except Exception:  # only a bug of ours lands here: say so loudly, keep the worker alive
                log.exception("outbox: could not hand a malformed message to %s; rejecting it", POISON_TASK)
                try:
                    message.reject_log_error(log, consumer.connection_errors)
                except Exception:  # pragma: no cover - the channel is gone; the broker redelivers
                    log.exception("outbox: could not reject the malformed message either")

        for name, strategy in list(strategies.items()):
            if getattr(strategy, _GATED, False):
                continue
            task = self.app.tasks.get(name)
            if task is None or getattr(task, "Strategy", None) in CONSUMER_STRATEGIES:
                continue  # consumer tasks check their own messages (strategy.guarded)
            strategies[name] = self.gated(task, getattr(strategy, "__wrapped__", strategy), to_poison)

        def on_unknown_task(body: Any, message: Any, exc: Any) -> None:
            name = _header(message, "task")
            to_poison(message, f"no task named {storable_text(repr(name), limit=220)} is registered on this worker")

        def on_unknown_message(body: Any, message: Any) -> None:
            to_poison(message, "not a Celery task message (no task header)")

        def on_invalid_task(body: Any, message: Any, exc: Any) -> None:
            to_poison(message, f"Celery refused the task message: {_error(exc)}")

        def on_decode_error(message: Any, exc: Any) -> None:
            to_poison(message, f"the message body cannot be decoded: {_error(exc)}")

        consumer.on_unknown_task = on_unknown_task
        consumer.on_unknown_message = on_unknown_message
        consumer.on_invalid_task = on_invalid_task
        consumer.on_decode_error = on_decode_error
        if getattr(consumer, "task_consumer", None) is not None:
            consumer.task_consumer.on_decode_error = on_decode_error

    def gated(self, task: Any, inner: Callable[..., Any], to_poison: Callable[..., None]) -> Callable[..., Any]:
        """``inner`` (Celery's strategy of ``task``) behind the rule table."""
        rules = self.rules_for(task)
        check = self.check_poison if task.name == POISON_TASK else self.check

        def task_message_handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any) -> Any:
            try:
                canonical = check(message, body, task.name, rules)
            except OutboxError as e:
                return to_poison(message, str(e), ack, reject)
            except Exception as e:  # anything unforeseen is still only this message's problem
                return to_poison(message, f"unreadable message ({_error(e)})", ack, reject)
            try:
                return inner(canonical, None, ack, reject, callbacks)
            except Exception as e:  # Celery's own strategy refused what we passed: still a dead letter
                return to_poison(message, f"Celery refused the task message: {_error(e)}", ack, reject)

        setattr(task_message_handler, _GATED, True)
        task_message_handler.__wrapped__ = inner  # type: ignore[attr-defined]
        return task_message_handler

    def check(self, message: Any, body: Any, name: str, rules: TaskRules) -> CanonicalMessage:
        """The message rebuilt from its checked values; ``MalformedMessageError`` saying why not."""
        if body is not None:
            raise MalformedMessageError("not a Celery protocol 2 message (the task is named in the body)")
        headers = message.headers
        if not isinstance(headers, Mapping) or headers.get("task") != name:
            raise MalformedMessageError("the task header does not name this task")
        raw = raw_bytes(message)
        # decode_body then check_call, skipping only the argument walks the raw text proves would find nothing.
        call = check_message(headers, raw, content_type=getattr(message, "content_type", None),
                             content_encoding=getattr(message, "content_encoding", None),
                             max_bytes=body_limit(self.settings), rules=rules)
        if call.dropped_trace_headers:
            self.trace_headers_dropped.note(call.dropped_trace_headers, task=name)
        properties = dict(mapping_attr(message, "properties"))
        if properties.get("correlation_id") == headers.get("id"):
            properties["correlation_id"] = call.task_id
        # The body the pool decodes is the raw one: strict UTF-8 JSON that decodes to ``call.body`` (the
        # checks change no argument), so re-encoding it would only repeat the same text's value.
        return CanonicalMessage(message, headers=call.headers, payload=call.body, body=raw,
                                delivery_info=dict(mapping_attr(message, "delivery_info")), properties=properties)

    def check_poison(self, message: Any, body: Any, name: str, rules: TaskRules) -> CanonicalMessage:
        """A message for the poison task itself: exactly one intact ``MalformedDelivery``, nothing else."""
        canonical = self.check(message, body, name, rules)
        args, kwargs, embed = canonical.payload
        if not (len(args) == 1 and isinstance(args[0], str) and kwargs == {}
                and not any((embed or {}).values())):
            raise MalformedMessageError(f"a {POISON_TASK} message carries exactly one malformed delivery")
        if MalformedDelivery.decode(args[0]) is None:
            raise MalformedMessageError(f"the {POISON_TASK} message's malformed delivery is damaged")
        canonical_task_id(canonical.headers.get("id"))
        return canonical

    def poison_message(self, message: Any, error: str) -> CanonicalMessage:
        """The message ``celery_outbox.poison`` runs for the malformed ``message``: valid by construction."""
        try:
            raw = raw_bytes(message)
        except Exception as e:
            raw = f"<body unreadable: {e.__class__.__name__}>".encode()
        headers = _headers(message)
        tid = stable_task_id(headers.get("id"), raw)
        arg = malformed_text(message, raw, headers, tid, error, self.settings, whole=True)
        info = mapping_attr(message, "delivery_info")
        route_exchange, route_key = info.get("exchange"), info.get("routing_key")
        return CanonicalMessage(
            message,
            headers={"lang": "py", "task": POISON_TASK, "id": tid, "root_id": tid, "parent_id": None, "group": None,
                     "retries": 0, "eta": None, "expires": None, "timelimit": [None, None],
                     "argsrepr": f"(malformed {storable_text(repr(headers.get('task')), limit=120)})",
                     "kwargsrepr": "{}", "origin": None, "ignore_result": True},
            payload=[[arg], {}, dict(EMBED)], body=single_argument_body(arg),
            delivery_info={"exchange": route_exchange if isinstance(route_exchange, str) else None,
                           "routing_key": route_key if isinstance(route_key, str) else None,
                           "redelivered": info.get("redelivered") is True, "priority": None},
            properties={"correlation_id": tid, "priority": None},
        )


def _headers(message: Any) -> Mapping[str, Any]:
    try:
        headers = message.headers
    except Exception:
        return {}
    return headers if isinstance(headers, Mapping) else {}


def _header(message: Any, key: str) -> Any:
    return _headers(message).get(key)


def _error(e: BaseException) -> str:
    try:
        text = f"{e.__class__.__name__}: {e}"
    except Exception:
        text = f"{e.__class__.__name__}: <unprintable>"
    return storable_text(text, limit=1000)


def poison_target(malformed: MalformedDelivery) -> tuple[str, str]:
    """(task name, dead-letter key) of a malformed delivery: the task it named, else ``UNNAMED``."""
    name = malformed.headers.get("task")
    if not isinstance(name, str) or not name or len(name) > TYPE_MAX_CHARS:
        name = UNNAMED
    return name, task_key(name)


def define_poison_task(outbox: Any) -> Any:
    """``celery_outbox.poison``: write one malformed message's dead letter, in the pool (module docstring)."""
    app = outbox.app
    settings = outbox.settings
    soft_limit, hard_limit = consumer_time_limits(settings)
    backoff = RetryPolicy().resolve(settings, broker_url=str(settings.broker_url or app.conf.broker_url or ""))
    retry_limit = poison_retry_limit(settings)

    @app.task(  # type: ignore[untyped-decorator]
        name=POISON_TASK, bind=True, acks_late=True, reject_on_worker_lost=True, acks_on_timeout=False,
        ignore_result=True, max_retries=None, shared=False, time_limit=hard_limit, soft_time_limit=soft_limit,
    )
    def poison(self: Any, text: str) -> str:
        malformed = MalformedDelivery.decode(text)
        if malformed is None:  # the gate lets only intact ones through; a direct call gets a clear error
            raise MalformedMessageError(f"{POISON_TASK} takes one malformed delivery")
        name, key = poison_target(malformed)
        message_id = malformed.task_id or ""
        try:
            recorded = record_poison(outbox, malformed, name=name, key=key, message_id=message_id)
        except Exception as e:
            retries = int(self.request.retries or 0)
            if not isinstance(e, DatabaseError) and retries + 1 >= backoff.max_deliveries:
                log.exception("outbox: giving up on recording the dead letter of %s (%s)", name, message_id)
                raise
            if len(text) > retry_limit:  # too big to travel again as a message of its own (module docstring)
                if not isinstance(e, DatabaseError):
                    log.exception("outbox: giving up on recording the dead letter of %s (%s)", name, message_id)
                    raise
                time.sleep(min(backoff.delay_s(1), soft_limit / 2))
                raise Reject(f"the database is down ({_error(e)}): the broker delivers the message again",
                             requeue=True) from None
            countdown, route = delayed_retry.retry_options(self, backoff.delay_s(retries + 1))
            raise self.retry(countdown=countdown, max_retries=None, exc=DatabaseError(_error(e)),
                             **route) from None
        if recorded:
            events.dead_lettered(app, source="consumer", consumer=key, message_id=message_id, error=malformed.error,
                                 event_type=name, attempts=1, **events.task_sender(self))
        raise DeadLettered(storable_text(f"dead-lettered for {key}: {malformed.error}", limit=1000))

    return poison


# What the poison task's message adds around its one argument: ``[["<text>"], {}, <embed>]``.
_POISON_FRAME_BYTES = 4096


def poison_retry_limit(settings: Any) -> int:
    """The longest malformed-delivery text the poison task re-sends as a retry: its message must pass the
    gate's size check (``check_poison``) again. A longer one (a body of a few hundred KiB or more, kept whole)
    is not re-sent: the original message is rejected back to the broker and dead-lettered on redelivery."""
    return int(body_limit(settings)) - _POISON_FRAME_BYTES


def record_poison(outbox: Any, malformed: MalformedDelivery, *, name: str, key: str, message_id: str) -> bool:
    """Write the dead letter of ``malformed`` (once: a redelivery finds it open); True when written now."""
    now = outbox.clock.now_ms()
    with wrap_driver_errors(f"recording the dead letter of a malformed {name} message"), \
            outbox.sessions()() as session:
        if dead_letters.is_open(session, tables=outbox.tables, consumer=key, message_id=message_id):
            return False
        dead_letters.record(
            session, tables=outbox.tables, consumer=key, message_id=message_id, type=name, body=malformed.body,
            headers={"broker_headers": malformed.headers, "content_type": malformed.content_type,
                     "content_encoding": malformed.content_encoding},
            delivery_count=1, last_error=malformed.error, first_failed_at_ms=now, last_failed_at_ms=now)
        session.commit()
    return True
