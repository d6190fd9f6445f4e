"""Idempotent Celery tasks (``@outbox.task``): the effect and the inbox row commit in one transaction.

    @outbox.task(name="orders.send_confirmation", max_retries=4)
    def send_confirmation(session, order_id):
        session.add(Confirmation(order_id=order_id))   # write with the session; never commit

A task defined here is an ordinary Celery task (``.delay()``, ``apply_async``, Flower, ``celery
inspect``) whose run is one delivery of the consumer machinery, reused as it is: the call becomes an
envelope (``message_id`` = the task id, ``type`` = the task name, ``payload`` = ``{"args", "kwargs"}``,
``headers.outbox_kind`` = ``"task"``) delivered by ``delivery.deliver`` to a consumer spec whose name
is the task's inbox key (``inbox.task_keys.task_key``) and whose handler calls the function with the
session. So:

* the inbox row ``(task id, key)`` and the function's writes commit together (``inbox.handle``); a
  second run of the same task id (a broker redelivery, a relay duplicate, a worker killed after the
  commit and before the ack) finds the row and returns without effect, counted as a duplicate;
* a raise rolls everything back and becomes ``self.retry`` with the task's policy
  (``max_retries``, ``retry_backoff``, ``retry_backoff_max``, ``retry_jitter``: ``policy.RetryPolicy``,
  defaults from the consumer settings); deliveries are counted in the database (``inbox.attempts``),
  so deliveries lost with a killed worker count too;
* after ``max_retries + 1`` deliveries the call lands in the consumer dead-letter store under the
  task's key, its arguments kept, and the message is rejected (``DeadLettered``). ``outbox
  dead-letters replay consumer:<id>`` (and the web pages) re-send it as the same task with the same
  task id (``celery.sender``), so the inbox still guards it.

The Celery task itself: ``bind``, ``acks_late``, ``reject_on_worker_lost``, ``acks_on_timeout=False``
and the consumer time limits (``config.consumer_time_limits``): a worker killed or hard-timed-out
mid-task is redelivered and counted. Celery's own ``max_retries`` is ``None`` on it: the count in the
database decides when retrying ends, so a redelivery after a database outage is never dropped.

The function must not commit, roll back or close the session (the inbox commits): a commit inside
it raises ``ConfigError`` before anything is written, a rollback is detected after it returns; both
count as a failed delivery. A savepoint (``session.begin_nested()``) is fine.

Results: the function's return value when it ran, ``"duplicate of <task id>"`` for an absorbed
duplicate. Calling the task object directly (``send_confirmation(1)``) has no task id to guard and
is refused; use ``.apply()`` in tests, or call the plain function with a session.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session

from celery_outbox.celery.config import consumer_time_limits
from celery_outbox.celery.consumer_tasks import context_source, deliver_or_retry, finish
from celery_outbox.consumer import ConsumerSpec
from celery_outbox.delivery import parse_body
from celery_outbox.errors import ConfigError
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.inbox.task_keys import check_task_name, message_id_for, task_key
from celery_outbox.messages import TASK_KIND, Envelope
from celery_outbox.policy import RetryPolicy
from celery_outbox.runtime import Context

TaskFunction = Callable[..., Any]
"""``fn(session, *args, **kwargs)``: the effect; write with the session, never commit."""

RESERVED_OPTIONS = frozenset({
    "bind", "base", "acks_late", "reject_on_worker_lost", "acks_on_timeout", "max_retries", "autoretry_for",
    "retry_kwargs", "default_retry_delay", "time_limit", "soft_time_limit", "shared", "typing", "Strategy",
})
"""``@app.task`` options an idempotent task sets itself: passing one is a ``ConfigError``."""


ARGUMENT_LEVELS = 3
"""How deep ``envelope_for`` nests an argument: envelope -> payload -> args list / kwargs object -> the argument."""


def envelope_for(name: str, task_id: str, args: Any, kwargs: Any) -> dict[str, Any]:
    """The envelope one run of task ``name`` is delivered as (and dead-lettered as)."""
    return {
        "message_id": str(message_id_for(task_id)), "type": name,
        "payload": {"args": list(args), "kwargs": dict(kwargs)},
        "headers": {"outbox_kind": TASK_KIND, "task": name, "task_id": task_id},
        "created_at_ms": 0,
    }


def task_call(envelope: Mapping[str, Any]) -> tuple[str, str, list[Any], dict[str, Any]] | None:
    """``(name, task_id, args, kwargs)`` of an envelope ``envelope_for`` built; None when it is not one."""
    headers = envelope.get("headers")
    payload = envelope.get("payload")
    if not isinstance(headers, Mapping) or headers.get("outbox_kind") != TASK_KIND or not isinstance(payload, Mapping):
        return None
    name, task_id = envelope.get("type"), headers.get("task_id")
    args, kwargs = payload.get("args"), payload.get("kwargs")
    if not isinstance(name, str) or not isinstance(task_id, str) or not task_id or not isinstance(args, list) \
            or not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        return None
    return name, task_id, args, kwargs


def _call_signature(fn: TaskFunction, name: str) -> inspect.Signature:
    """The task's call signature: ``fn``'s without the session (Celery checks ``.delay()`` arguments with it)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY),
                                  inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                                  inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                            inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                            inspect.Parameter.VAR_POSITIONAL):
        raise ConfigError(f"idempotent task {name!r}: the function must take the session as its first positional "
                          f"parameter, e.g. def {getattr(fn, '__name__', 'task')}(session, ...)")
    rest = params if params[0].kind is inspect.Parameter.VAR_POSITIONAL else params[1:]
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    return sig.replace(parameters=[this, *rest], return_annotation=inspect.Signature.empty)


def _run_guarded(fn: TaskFunction, session: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call ``fn`` inside the inbox transaction; a commit or rollback of that transaction by ``fn`` fails it."""
    transaction = session.get_transaction()

    def refuse_commit(s: Session) -> None:
        if not s.in_nested_transaction():  # a savepoint's release is fine
            raise ConfigError("an idempotent task must not commit its session: the inbox commits the effect "
                              "together with its inbox row")

    sa.event.listen(session, "before_commit", refuse_commit)
    try:
        result = fn(session, *args, **kwargs)
    finally:
        sa.event.remove(session, "before_commit", refuse_commit)
    if session.get_transaction() is not transaction:
        raise ConfigError("an idempotent task must not roll back or close its session: the inbox row and the "
                          "effect must stay in one transaction")
    return result


def _not_called(session: Session, envelope: Envelope) -> None:  # pragma: no cover - replaced per run
    raise AssertionError("the per-run handler replaces this one")


def define(app: Celery, ctx: Context, fn: TaskFunction, *, name: str, policy: RetryPolicy,
           options: Mapping[str, Any] | None = None) -> Any:
    """Define the idempotent task ``name`` running ``fn(session, *args, **kwargs)`` on ``app``; return it."""
    check_task_name(name)
    options = dict(options or {})
    reserved = sorted(RESERVED_OPTIONS & set(options))
    if reserved:
        raise ConfigError(f"idempotent task {name!r}: {', '.join(reserved)} cannot be set, the outbox sets "
                          "them itself (retries: max_retries/retry_backoff/retry_backoff_max/retry_jitter)")
    if name in app._tasks:  # Celery would silently hand back the task already registered under that name
        raise ConfigError(f"a task named {name!r} is already registered on this Celery app")
    settings = ctx.settings
    backoff = policy.resolve(settings, broker_url=str(settings.broker_url or app.conf.broker_url or ""))
    soft_limit, hard_limit = consumer_time_limits(settings)
    key = task_key(name)
    base_spec = ConsumerSpec(name=key, events=frozenset({name}), handler=_not_called, policy=policy)
    max_depth = settings.max_json_depth
    context = context_source(ctx, base_spec, policy=backoff, wrapper_levels=ARGUMENT_LEVELS)

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        request_id = self.request.id
        if not isinstance(request_id, str) or not request_id:
            raise ConfigError(f"idempotent task {name!r} was called without a task id (a direct call?): use "
                              ".delay(), .apply_async() or, in tests, .apply()")
        envelope = envelope_for(name, request_id, args, kwargs)
        returned: list[Any] = []

        def handler(session: Session, _: Envelope) -> None:
            returned.append(_run_guarded(fn, session, args, kwargs))

        parsed = parse_body(envelope, max_depth=max_depth)
        result = deliver_or_retry(self, ctx.sessions, replace(context(), spec=replace(base_spec, handler=handler)), parsed,
                                  request_id=envelope["message_id"])
        if result.outcome is Outcome.PROCESSED:
            return returned[0] if returned else None
        return finish(self, app, key, parsed, result)

    run.__signature__ = _call_signature(fn, name)  # type: ignore[attr-defined]
    run.__name__ = getattr(fn, "__name__", "run")
    run.__qualname__ = getattr(fn, "__qualname__", run.__name__)
    run.__module__ = getattr(fn, "__module__", __name__)
    run.__doc__ = getattr(fn, "__doc__", None)
    task = app.task(
        name=name, bind=True, acks_late=True, reject_on_worker_lost=True, acks_on_timeout=False, max_retries=None,
        time_limit=hard_limit, soft_time_limit=soft_limit, shared=False, lazy=False,  # registered now: one per name
        outbox_task_key=key, outbox_policy=policy, outbox_function=fn, outbox_context=staticmethod(context),
        **options,
    )(run)
    return task
