"""Deduplicate by key: at most one pending outbox task per key (docs/scheduled.md, "Deduplicate by key").

A task sent with a dedup key (``apply_async(headers={"outbox_dedup_key": K})`` or
``outbox.enqueue(session, sig, dedup_key=K)``) is written so that at most one pending row holds K:

- ``keep`` (the default): a pending row with K already exists, so the new task is not written; the
  first one stays, with its arguments and due time (one pending "recompute cart" per cart);
- ``replace``: the pending row with K is deleted and the new task written in its place (the latest
  arguments win; with a countdown this is a debounce).

The guarantee is the partial unique index ``ux_<prefix>dedup`` on pending rows with a key, not a
read: the write is ``DELETE`` (replace only) then ``INSERT ... ON CONFLICT DO NOTHING``, and a
conflict is looked at again. On Postgres the writers of one key also take a transaction-level advisory
lock on it first, so they run one after another: a second transaction writing K waits for the first to
commit and then sees its row (keep reports it, replace deletes it and writes its own). Without that lock,
replacers racing on one key each saw their insert conflict with the row another had just committed, and
eight writers of three keys could run out of attempts (tests/tasks/test_dedup.py).
A row the relay is publishing (it holds the row lock)
makes a replace wait; the relay marks it published, so it leaves the index and the new row goes in
beside it: the old task ran or runs, the new one is pending. A replace never rewrites a row in
place: on SQLite the relay's mark matches rows by seq, and a rewritten row would be marked
published without its message ever being sent. A dead-lettered row gives its key up (the relay
clears the column; the key stays in its headers), so its replay never conflicts with a newer task.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox.db import wrap_driver_errors
from celery_outbox.errors import ConfigError, ValidationError
from celery_outbox.schema import Tables

KEY_HEADER = "outbox_dedup_key"
ON_CONFLICT_HEADER = "outbox_dedup_on_conflict"
KEEP, REPLACE = "keep", "replace"
OnConflict = Literal["keep", "replace"]
MAX_KEY = 200  # the column's length
ATTEMPTS = 5  # each retry follows a commit of another writer of the same key; more means a bug, said loudly


@dataclass(frozen=True, kw_only=True)
class Deduplicated:
    """What a write with a dedup key did, and which task is now the key's pending one."""

    key: str
    outcome: Literal["written", "kept", "replaced"]
    message_id: uuid.UUID  # the pending task holding the key after this write
    replaced: uuid.UUID | None = None  # the task a replace deleted


ONE_TASK_ONLY = ("a dedup key takes one task's signature (task.s(...)), not a chain or a group: one key, one "
                 "pending task; nothing was written")


def check_one_task(headers: Any, body: Any, *, task: str) -> None:
    """A message sent with a dedup key is one task: not a chain's first step (its embed carries the rest),
    not a member of a group (Celery sends each with the group's id). One rule for
    ``apply_async(headers={KEY_HEADER: K})`` and ``outbox.enqueue(..., dedup_key=K)``."""
    embed = body[2] if isinstance(body, (list, tuple)) and len(body) == 3 else None
    chained = isinstance(embed, dict) and bool(embed.get("chain"))
    grouped = isinstance(headers, dict) and headers.get("group") is not None
    if chained or grouped:
        raise ValidationError(f"task {task[:200]!r}: {ONE_TASK_ONLY}")


def check(key: Any, on_conflict: Any, *, task: str) -> tuple[str, OnConflict]:
    """The key and mode, or a one-line ``ValidationError`` saying what is wrong (nothing is written)."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY or "\x00" in key or not key.isprintable():
        shown = repr(key)[:60]
        raise ValidationError(f"task {task!r}: the dedup key must be a printable string of 1 to {MAX_KEY} "
                              f"characters, got {shown}; nothing was written")
    if on_conflict is None or on_conflict == KEEP:
        return key, "keep"
    if on_conflict == REPLACE:
        return key, "replace"
    raise ValidationError(f"task {task!r}: on_conflict must be 'keep' or 'replace', got {repr(on_conflict)[:40]}; "
                          "nothing was written")


def _insert(dialect: str) -> Any:
    if dialect == "postgresql":
        from sqlalchemy.dialects import postgresql
        return postgresql.insert
    if dialect == "sqlite":
        from sqlalchemy.dialects import sqlite
        return sqlite.insert
    raise ConfigError(f"deduplication by key needs Postgres or SQLite (INSERT ... ON CONFLICT), not {dialect}")


def write_unique(session: Session, values: dict[str, Any], *, key: str, on_conflict: OnConflict,
                 tables: Tables) -> Deduplicated:
    """Write the task row ``values`` in ``session``'s transaction unless ``on_conflict`` says to keep
    the pending row that already holds ``key``. On the session's connection: no autoflush of the
    caller's pending objects, and the row is in the database (and the index) when this returns."""
    outbox = tables.table(tables.outbox)
    conn = session.connection()
    insert = _insert(conn.dialect.name)
    holder = sa.and_(outbox.c.dedup_key == key, outbox.c.published_at_ms.is_(None),
                     outbox.c.dead_lettered_at_ms.is_(None))
    stmt = (insert(outbox).values(**values, dedup_key=key)
            .on_conflict_do_nothing(index_elements=[outbox.c.dedup_key],
                                    index_where=sa.and_(outbox.c.published_at_ms.is_(None),
                                                        outbox.c.dead_lettered_at_ms.is_(None),
                                                        outbox.c.dedup_key.is_not(None)))
            .returning(outbox.c.message_id))
    replaced: uuid.UUID | None = None
    with wrap_driver_errors(f"writing task {values['type']!r} with dedup key {key[:80]!r}"):
        if conn.dialect.name == "postgresql":  # SQLite writers are serialized by its database lock already
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(
                sa.func.hashtextextended(sa.literal(f"{outbox.name}:{key}"), 0))))
        for _ in range(ATTEMPTS):
            if on_conflict == REPLACE:
                gone = conn.execute(sa.delete(outbox).where(holder).returning(outbox.c.message_id)).first()
                replaced = gone[0] if gone is not None else replaced
            if conn.execute(stmt).first() is not None:
                return Deduplicated(key=key, outcome="replaced" if replaced else "written",
                                    message_id=values["message_id"], replaced=replaced)
            if on_conflict == KEEP:
                held = conn.execute(sa.select(outbox.c.message_id).where(holder)).first()
                if held is not None:
                    return Deduplicated(key=key, outcome="kept", message_id=held[0])
            # The row that conflicted was published, dead-lettered or replaced meanwhile: try again.
    raise ConfigError(f"task {values['type']!r}: dedup key {key[:80]!r} kept conflicting after {ATTEMPTS} writes "
                      "(another process writing it in a loop?); nothing was written")
