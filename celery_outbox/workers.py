"""The worker registry: which task names (and versions) the live workers of each queue run.

Deploy-safe publishing (docs/scheduled.md, "Deploys"). Every ``celery worker`` of an ``Outbox`` app
writes one row at start (``register``: its queues, its task names with their ``@outbox.task(version=N)``,
1 when unversioned), refreshes it on a heartbeat and deletes it at a warm shutdown; a killed worker's row
expires after ``EXPIRY_HEARTBEATS`` missed heartbeats. The relay reads the live rows once per batch that
holds task rows (a handful of rows, not the outbox) and holds a task row while some live worker of its
queue cannot run it (``why_held``), without charging an attempt.

A queue with no live registered worker is not held for: a relay must not stall every task when no worker
writes the registry yet (workers older than it, or ``OUTBOX_WORKER_HEARTBEAT_MS=0``); the workers' own
gate (celery/gate.py) still dead-letters a task they do not know, never discards it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox.db import wrap_driver_errors
from celery_outbox.schema import Tables

EXPIRY_HEARTBEATS = 3  # a worker silent this many heartbeats is not live
VERSION_HEADER = "task_version"  # an outbox task row's header: the version its message was written for


@dataclass(frozen=True, kw_only=True)
class Registry:
    """The live workers' task tables per queue: ``queues[q]`` is one ``{task: version}`` per live worker."""

    queues: Mapping[str, tuple[Mapping[str, int], ...]]

    def why_held(self, *, queue: str, task: str, version: int) -> str | None:
        """Why a task row for ``queue`` must wait, or None when it can go out now.

        It waits while any live registered worker of ``queue`` does not run ``task`` at ``version`` or
        later (a worker's version N declares it accepts messages written for versions up to N): a message
        on a shared queue goes to whichever worker takes it first. A queue no live worker registered is
        never held for (nothing is known about it)."""
        workers = self.queues.get(queue)
        if not workers:
            return None
        if all(w.get(task, 0) >= version for w in workers):
            return None
        return f"{task} v{version} on queue {queue}" if version > 1 else f"{task} on queue {queue}"


EMPTY = Registry(queues={})


def live(session: Session, now_ms: int, *, heartbeat_ms: int, tables: Tables) -> Registry:
    """The registry of workers whose last heartbeat is recent (one read of a table of a few rows)."""
    w = tables.workers
    since = now_ms - EXPIRY_HEARTBEATS * heartbeat_ms
    queues: dict[str, list[Mapping[str, int]]] = {}
    with wrap_driver_errors("reading the worker registry"):
        for worker_queues, tasks in session.execute(
                sa.select(w.queues, w.tasks).where(w.heartbeat_at_ms >= since)):
            known = {str(k): int(v) for k, v in dict(tasks or {}).items() if isinstance(v, int)}
            for q in worker_queues or ():
                queues.setdefault(str(q), []).append(known)
    return Registry(queues={q: tuple(ws) for q, ws in queues.items()})


def row_target(headers: Mapping[str, Any]) -> tuple[str | None, int]:
    """(queue name, version) of an outbox task row: the queue Celery resolved at enqueue time (its
    declaration, else the routing key on the default exchange), the version 1 when unversioned."""
    raw_queue = headers.get("queue")
    queue: str | None = None
    if isinstance(raw_queue, Mapping) and isinstance(raw_queue.get("name"), str):
        queue = raw_queue["name"]
    elif not headers.get("exchange") and isinstance(headers.get("routing_key"), str):
        queue = headers["routing_key"]
    version = headers.get(VERSION_HEADER)
    return queue, version if isinstance(version, int) and not isinstance(version, bool) and version > 0 else 1


def register(session: Session, *, worker: uuid.UUID, name: str, queues: Sequence[str], tasks: Mapping[str, int],
             now_ms: int, tables: Tables) -> None:
    """Write (or replace) the row of ``worker`` (an id per worker start; ``name`` its node name) and commit."""
    w = tables.table(tables.workers)
    with wrap_driver_errors("registering the worker"):
        session.execute(sa.delete(w).where(w.c.id == worker))
        session.execute(sa.insert(w).values(id=worker, name=name[:255], queues=sorted(set(queues)),
                                            tasks=dict(sorted(tasks.items())), started_at_ms=now_ms,
                                            heartbeat_at_ms=now_ms))
        session.commit()


def heartbeat(session: Session, *, worker: uuid.UUID, now_ms: int, tables: Tables) -> bool:
    """Refresh ``worker``'s row and commit; False when it is gone (then register again)."""
    w = tables.table(tables.workers)
    with wrap_driver_errors("refreshing the worker registry"):
        res = session.execute(sa.update(w).where(w.c.id == worker).values(heartbeat_at_ms=now_ms))
        session.commit()
    return bool(getattr(res, "rowcount", 0))


def unregister(session: Session, *, worker: uuid.UUID, tables: Tables) -> None:
    """Delete ``worker``'s row and commit (a warm shutdown: the relay stops counting it at once)."""
    w = tables.table(tables.workers)
    with wrap_driver_errors("unregistering the worker"):
        session.execute(sa.delete(w).where(w.c.id == worker))
        session.commit()


def prune(session: Session, now_ms: int, *, heartbeat_ms: int, tables: Tables) -> int:
    """Delete rows of workers silent for ten expiry periods (killed workers); commits, returns how many."""
    w = tables.table(tables.workers)
    with wrap_driver_errors("pruning the worker registry"):
        res = session.execute(sa.delete(w).where(
            w.c.heartbeat_at_ms < now_ms - 10 * EXPIRY_HEARTBEATS * heartbeat_ms))
        session.commit()
    return int(getattr(res, "rowcount", 0) or 0)
