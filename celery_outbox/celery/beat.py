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

from celery_outbox.errors import ConfigError

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
    headers = dict(opts.pop("headers", None) or {})
    headers.update({BEAT_HEADER: name, BEAT_EVERY_HEADER: every_ms(schedule)})
    return {"task": task, "schedule": schedule, "args": tuple(args), "kwargs": dict(kwargs or {}),
            "options": {**opts, "headers": headers}}
