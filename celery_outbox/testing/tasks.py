"""Tasks enqueued through the outbox, in your own tests on SQLAlchemy: see them, and run them in this process.

The twin of ``celery_outbox.contrib.django.testing`` (same names, same meaning):

    with Session.begin() as s, outbox.transaction(s):
        place_order(s, ...)                                  # calls send_confirmation.delay(...)
    [message] = enqueued_tasks(outbox)                       # what the relay would publish
    assert message.headers["task"] == "shop.send_confirmation"
    run_enqueued_tasks(outbox)                               # and what a worker would run

Rows are read through ``session`` when you pass one (its uncommitted rows included: a test that never
commits; what the tasks send becomes rows of that session too), else in a session of the outbox's own
(committed rows). Each message is built with the
relay's own ``messages.task_row_message`` (a row the relay would refuse fails here too), its row is
marked published (the relay's mark: it never runs twice), and the task runs eagerly on this thread
with Celery's ``Task.apply``: its id, arguments, headers, routing key, callbacks and the chain's next
step, as a worker does (``apply_message``);
a countdown or eta is not waited for. A task that sends another task writes a new row (in a
transaction of its own when none is bound), run in the next round.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from celery import signature
from sqlalchemy.orm import Session

from celery_outbox.errors import ConfigError
from celery_outbox.messages import TaskMessage, is_task_row, task_row_message

__all__ = ["apply_message", "enqueued_tasks", "run_enqueued_tasks", "run_in_rounds", "run_task_message"]


@contextmanager
def _session(outbox: Any, session: Session | None) -> Iterator[Session]:
    if session is not None:
        yield session
        return
    with outbox.sessions()() as own, own.begin():
        yield own


def _pending_task_rows(outbox: Any, session: Session) -> list[Any]:
    model = outbox.tables.outbox
    rows = session.execute(sa.select(model).where(model.published_at_ms.is_(None), model.dead_lettered_at_ms.is_(None))
                           .order_by(model.seq)).scalars()
    return [row for row in rows if is_task_row(row.headers)]


def row_message(outbox: Any, row: Any) -> TaskMessage:
    """The message the relay would publish for task row ``row`` (the relay's own builder)."""
    return task_row_message(message_id=row.message_id, type=row.type, payload=row.payload, headers=row.headers,
                            max_bytes=outbox.settings.max_message_bytes)


def enqueued_tasks(outbox: Any, *, session: Session | None = None) -> list[TaskMessage]:
    """The task messages pending in the outbox, in order, as the relay would publish them (nothing is marked)."""
    with _session(outbox, session) as s:
        return [row_message(outbox, row) for row in _pending_task_rows(outbox, s)]


def run_enqueued_tasks(outbox: Any, *, session: Session | None = None, max_rounds: int = 100, throw: bool = True,
                       ) -> list[Any]:
    """Mark every pending task row published and run its task eagerly, in order; then again for the rows
    those tasks wrote, until none is left. Returns Celery's ``EagerResult`` of each run.

    ``throw=False`` keeps going after a failing task (its result says FAILURE). Raises ``ConfigError``
    for a task this process does not register, or when tasks keep enqueuing tasks past ``max_rounds``.
    """
    def take() -> list[TaskMessage]:
        with _session(outbox, session) as s:
            messages = []
            for row in _pending_task_rows(outbox, s):
                messages.append(row_message(outbox, row))
                row.published_at_ms = outbox.clock.now_ms()
            if session is not None:
                s.flush()
        return messages

    return run_in_rounds(take, lambda m: run_task_message(outbox, m, throw=throw, session=session),
                         max_rounds=max_rounds)


def run_in_rounds(take: Callable[[], list[TaskMessage]], run: Callable[[TaskMessage], Any], *,
                  max_rounds: int) -> list[Any]:
    """The rounds of ``run_enqueued_tasks`` here and in its Django twin: ``take()`` the pending task messages
    (their rows marked published, as the relay marks them), ``run`` each in order, then again for what they
    sent, until none is left. Returns what ``run`` returned; ``ConfigError`` past ``max_rounds``."""
    results: list[Any] = []
    for _ in range(max_rounds):
        messages = take()
        if not messages:
            return results
        results.extend(run(m) for m in messages)
    raise ConfigError(f"tasks were still enqueuing tasks after {max_rounds} rounds; a task that enqueues itself?")


def run_task_message(outbox: Any, message: TaskMessage, *, throw: bool = True, session: Session | None = None) -> Any:
    """What a worker does with a task ``message`` (``apply_message``), eagerly on this thread, with what
    it sends captured. Returns Celery's ``EagerResult``.

    What the task sends (a ``.delay()`` in its body, the chain's next step) becomes outbox rows of
    ``session``, or of a session of the outbox's own committed after the run, never a message sent to
    the app's broker (Celery counts an eagerly run task as a running worker task, which sends directly)."""
    with _session(outbox, session) as s, outbox.transaction(s):
        return apply_message(outbox.app, message, throw=throw)


def apply_message(app: Any, message: TaskMessage, *, throw: bool) -> Any:
    """Run task ``message`` with Celery's ``Task.apply`` as a worker would: its id, arguments, retries,
    headers (trace context, your own) and routing key (the queue a worker took it from), its links and
    errbacks, then the chain's next step on its result. Returns Celery's ``EagerResult``.

    One runner for this module and its Django twin (contrib/django/testing.py), so a test runs a task
    the same way on either. Sending is the caller's business (bind the outbox first). Raises
    ``ConfigError`` for a task ``app`` does not register."""
    name = str(message.headers["task"])
    if name not in app.tasks:
        raise ConfigError(f"task {name!r} is enqueued but not registered in this process: import the module that "
                          "defines it (a worker would reject it too)")
    args, kwargs, embed = json.loads(message.body)
    embed = embed or {}
    links = [signature(s, app=app) for s in embed.get("callbacks") or ()]
    errbacks = [signature(s, app=app) for s in embed.get("errbacks") or ()]
    result = app.tasks[name].apply(args=args, kwargs=kwargs, task_id=str(message.headers["id"]),
                                   retries=message.headers.get("retries") or 0, link=links or None,
                                   link_error=errbacks or None, throw=throw, headers=dict(message.headers),
                                   routing_key=message.routing_key)
    chain = list(embed.get("chain") or ())
    if chain and result.successful():  # as Celery's tracer does: the next step gets the result
        following = signature(chain.pop(), app=app)
        following.apply_async((result.result,), chain=chain or None)
    return result
