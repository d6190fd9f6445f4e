"""Periodic tasks through the outbox: a beat tick is an outbox row with an id made from its entry and
its slot, so a ``celery beat`` restart never loses or doubles a tick (docs/scheduled.md, "Periodic tasks").

``Outbox.periodic(name, task, schedule, ...)`` adds a ``beat_schedule`` entry whose messages carry two
headers (``BEAT_HEADER``: the entry's name, ``BEAT_EVERY_HEADER``: its period in ms, 60 s for a crontab,
whose finest step is a minute). In the beat process the outbox's sender (celery/enqueue.py) sees them
and, instead of publishing, writes the row in a transaction of its own with:

- the task id ``uuid5(NAMESPACE, "beat:<entry>:<slot>")``, the slot being the start of the period the
  tick falls in (``now - now % every``): beat fires an entry once per period, so two ticks of one slot
  are the same tick sent twice (a beat restarted from a stale schedule file fires at once);
- the outbox's unique ``message_id``: the second write of a slot writes nothing (checked first, and a
  concurrent one fails on the index and is dropped), also after the first was published.

Entries without the headers are sent by beat as Celery sends them (not the default: see the docs).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery.schedules import crontab
from celery.schedules import schedule as interval

from celery_outbox.errors import ConfigError, OutboxError
from celery_outbox.messages import TYPE_MAX_CHARS, encode_json
from celery_outbox.task_route import TEXT_PROPERTIES, check_properties
from celery_outbox.task_rules import _check_storable

BEAT_HEADER = "outbox_beat"
BEAT_EVERY_HEADER = "outbox_beat_every_ms"
TICK_HEADER = "beat_tick"  # the row's header naming its tick (outbox trace)
NAMESPACE = uuid.UUID("5b0f1c2e-7c57-4c55-9b39-0d7c9e4e0a61")
MINUTE_MS = 60_000


@dataclass(frozen=True, kw_only=True)
class Tick:
    key: str  # beat:<entry>:<slot start, ms>
    task_id: uuid.UUID


def every_ms(schedule: Any) -> int:
    """The period of a beat schedule in ms: a number (seconds), a timedelta, ``schedule(run_every)``;
    a crontab ticks at most once a minute, so its slot is the minute."""
    if isinstance(schedule, crontab):
        return MINUTE_MS
    if isinstance(schedule, interval):
        schedule = schedule.run_every
    if isinstance(schedule, timedelta):
        schedule = schedule.total_seconds()
    if isinstance(schedule, bool) or not isinstance(schedule, (int, float)) or not 1 <= schedule <= 366 * 86_400:
        raise ConfigError(f"a periodic task through the outbox needs a schedule of 1 s to a year, a timedelta, "
                          f"celery.schedules.schedule or crontab; got {schedule!r}")
    return round(schedule * 1000)


def tick_of(headers: Mapping[str, Any], now_ms: int) -> Tick | None:
    """The tick a beat message is (None when it is not an outbox periodic task)."""
    name, every = headers.get(BEAT_HEADER), headers.get(BEAT_EVERY_HEADER)
    if not isinstance(name, str) or not name or isinstance(every, bool) or not isinstance(every, int) or every < 1:
        return None
    key = f"beat:{name}:{now_ms - now_ms % every}"
    return Tick(key=key, task_id=uuid.uuid5(NAMESPACE, key))


def entry(name: str, task: str, schedule: Any, *, args: Any = (), kwargs: Mapping[str, Any] | None = None,
          options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A ``beat_schedule`` entry whose ticks go through the outbox."""
    if not isinstance(name, str) or not name or len(name) > 150 or not name.isprintable():
        raise ConfigError(f"a periodic task's name must be 1-150 printable characters, got {name!r}")
    opts = dict(options or {})
    _check_call(name, task, args, kwargs, opts)
    headers = dict(opts.pop("headers", None) or {})
    headers.update({BEAT_HEADER: name, BEAT_EVERY_HEADER: every_ms(schedule)})
    return {"task": task, "schedule": schedule, "args": tuple(args), "kwargs": dict(kwargs or {}),
            "options": {**opts, "headers": headers}}


def _check_call(name: str, task: Any, args: Any, kwargs: Any, options: Mapping[str, Any]) -> None:
    """What every tick would send, judged once here: a task name, JSON arguments every database stores, and
    message properties every broker takes (``task_route``). Found only at a tick, each tick would fail in beat's
    log, period after period, and the task never run."""
    where = f"periodic task {name!r}"
    if not isinstance(task, str) or not task or len(task) > TYPE_MAX_CHARS or not task.isprintable():
        raise ConfigError(f"{where}: the task must be a task name (1-{TYPE_MAX_CHARS} printable characters), "
                          f"got {repr(task)[:60]}")
    if isinstance(args, (str, bytes, Mapping)) or not isinstance(args, (list, tuple)):
        raise ConfigError(f"{where}: args must be a list or tuple, got {type(args).__name__}")
    if kwargs is not None and (not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs)):
        raise ConfigError(f"{where}: kwargs must be a mapping with text keys, got {type(kwargs).__name__}")
    try:
        encode_json([list(args), dict(kwargs or {})], what="arguments (JSON only)")
        _check_storable([list(args), dict(kwargs or {})], what="arguments")
        check_properties({k: options[k] for k in ("priority", "timestamp", "expiration", *TEXT_PROPERTIES)
                          if options.get(k) is not None})
    except OutboxError as e:
        raise ConfigError(f"{where}: {e}") from None
