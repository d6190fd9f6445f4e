"""Due rows whose stored JSON the database driver cannot decode: dead-lettered, so the relay goes on.

The writers refuse such values (a payload nested deeper than the consumers accept, a number past Python's
4300 digits), but a row written by raw SQL or another writer can hold one: SQLite keeps JSON nested up to 1000
levels and Postgres' ``jsonb`` deeper, and both keep numbers of any length. Decoding it raises inside the
claim (``RecursionError``, ``ValueError``), so every batch holding the row failed and the relay published
nothing behind it. After such a failure, ``dead_letter_undecodable`` reads the same due rows with their JSON as
text, decodes each with the consumers' bounded decoder, and dead-letters the ones that cannot be read, saying
why; the next claim goes on with the rest (docs/design.md, rule 4: one bad row must not stop the relay).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox import counters
from celery_outbox.db import is_postgres, wrap_driver_errors
from celery_outbox.errors import MalformedMessageError
from celery_outbox.messages import decode_json
from celery_outbox.schema import Tables

# What a driver's JSON decoding raises on such a value (the claim is retried only after these)
UNDECODABLE = (RecursionError, ValueError)
# Deeper than any row a writer accepts, well within Python's recursion limit
_READ_DEPTH = 256


def dead_letter_undecodable(session: Session, now_ms: int, limit: int, *, tables: Tables) -> int:
    """Dead-letter the due rows (the claim's first ``limit``) whose payload or headers cannot be decoded, in a
    transaction of its own; returns how many."""
    outbox = tables.table(tables.outbox)
    stmt = (sa.select(outbox.c.seq, sa.cast(outbox.c.payload, sa.Text), sa.cast(outbox.c.headers, sa.Text))
            .where(outbox.c.published_at_ms.is_(None), outbox.c.dead_lettered_at_ms.is_(None),
                   outbox.c.next_attempt_at_ms <= now_ms)
            .order_by(outbox.c.next_attempt_at_ms, outbox.c.seq).limit(limit))
    if is_postgres(session):
        stmt = stmt.with_for_update(skip_locked=True)
    bad: dict[int, str] = {}
    with wrap_driver_errors("reading due outbox rows as text"):
        for seq, payload, headers in session.execute(stmt):
            for what, text in (("payload", payload), ("headers", headers)):
                if text is None or seq in bad:
                    continue
                try:
                    decode_json(text, max_depth=_READ_DEPTH, what=f"the stored {what}")
                except MalformedMessageError as e:
                    bad[seq] = f"unpublishable: {e}"
        for seq, why in bad.items():
            session.execute(sa.update(outbox).where(outbox.c.seq == seq, outbox.c.dead_lettered_at_ms.is_(None))
                            .values(dead_lettered_at_ms=now_ms, last_error=why[:2000]))
        counters.stage_increment(session, counters.RELAY, counters.DEAD_LETTERED, len(bad), tables=tables)
        session.commit()
    return len(bad)
