"""Cancel a task (or event) still waiting in the outbox, in the caller's transaction (docs/scheduled.md).

The cancel is a DELETE of the pending row in the caller's session: it commits or rolls back with the
caller's own data, and needs no worker to be up (Celery's ``revoke`` only reaches live workers). A
row the relay has already published cannot be cancelled here, and says so: ``AlreadyPublishedError``.
On Postgres the DELETE waits for a relay that holds the row (``FOR UPDATE SKIP LOCKED``) and then sees
whether it was marked published. SQLite's single relay holds no lock while it publishes, so a cancel
in that same instant can delete a row whose message is already on the wire (docs/scheduled.md).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox import counters
from celery_outbox.db import wrap_driver_errors
from celery_outbox.errors import AlreadyPublishedError, NotFoundError, ValidationError
from celery_outbox.schema import Tables

CANCELLED = "cancelled"  # the relay-scope counter of cancelled rows (``outbox stats``)


@dataclass(frozen=True, kw_only=True)
class Cancelled:
    """The pending row a cancel removed: what it was and when it was due."""

    message_id: uuid.UUID
    type: str
    due_at_ms: int


def task_uuid(task_id: str | uuid.UUID) -> uuid.UUID:
    if isinstance(task_id, uuid.UUID):
        return task_id
    try:
        return uuid.UUID(str(task_id))
    except ValueError:
        raise ValidationError(f"task id {str(task_id)[:80]!r} is not a UUID; nothing was cancelled") from None


def not_cancelled(message_id: uuid.UUID, published_at_ms: int | None) -> Exception:
    """The error for a row that was not deleted: published (``published_at_ms``) or never there."""
    if published_at_ms is not None:
        return AlreadyPublishedError(
            f"task {message_id} was already published (at {published_at_ms} ms): the outbox can no longer cancel "
            "it; a worker may be running it or have run it (Celery's revoke reaches only live workers)")
    return NotFoundError(f"no outbox row has task id {message_id} (never enqueued, rolled back, or published and "
                         "pruned by retention); nothing was cancelled")


def cancel(session: Session, task_id: str | uuid.UUID, *, tables: Tables) -> Cancelled:
    """Delete the pending (not yet published) outbox row of ``task_id`` in ``session``'s transaction
    (the caller commits); a dead-lettered row is cancelled too. Counts it (``cancelled``). Raises
    ``AlreadyPublishedError`` when the relay published it, ``NotFoundError`` when no row has the id."""
    message_id = task_uuid(task_id)
    outbox = tables.table(tables.outbox)
    with wrap_driver_errors(f"cancelling outbox row {message_id}"):
        row = session.execute(
            sa.delete(outbox).where(outbox.c.message_id == message_id, outbox.c.published_at_ms.is_(None))
            .returning(outbox.c.type, outbox.c.next_attempt_at_ms)).first()
        if row is None:
            published = session.execute(
                sa.select(outbox.c.published_at_ms).where(outbox.c.message_id == message_id)).first()
            raise not_cancelled(message_id, None if published is None else published[0])
        counters.stage_increment(session, counters.RELAY, CANCELLED, tables=tables)
    return Cancelled(message_id=message_id, type=str(row[0]), due_at_ms=int(row[1]))
