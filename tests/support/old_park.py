"""An ordered consumer's worker of the release before the parked marker, parking a message (a rolling deploy).

Its delivery locked the entity's row with a no-op upsert (``SET version = version``), which leaves the marker as
it is, and inserted the parked row: the statements of ``_lock_entity`` and the park as they were then
(inbox/ordering.py before the marker). The trigger of ``schema.parked_trigger`` is what sets the marker for it.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from celery_outbox.sql import insert_for


def park_as_the_release_before(session: Session, envelope: Envelope, *, tables: Tables, consumer: str,
                               now_ms: int = 1) -> int:
    """Lock ``envelope``'s entity and park it, as that release did (in ``session``'s transaction; the caller
    commits); returns the entity's applied version the lock read."""
    key, version = envelope.headers["entity_key"], int(envelope.headers["entity_version"])
    versions = tables.table(tables.entity_versions)
    applied = session.execute(
        insert_for(session, versions).values(consumer=consumer, entity_key=key, version=0)
        .on_conflict_do_update(index_elements=["consumer", "entity_key"], set_={"version": versions.c.version})
        .returning(versions.c.version)).scalar_one()
    assert version > applied + 1, "the release before parks only a version beyond the next one"
    session.execute(sa.insert(tables.table(tables.parked)).values(
        message_id=envelope.message_id, consumer=consumer, entity_key=key, entity_version=version,
        envelope=envelope.to_dict(), parked_at_ms=now_ms))
    return int(applied)
