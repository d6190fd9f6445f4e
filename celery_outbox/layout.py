"""Which physical layout the outbox table has: the plain table, or the optional partitioned one
(docs/partitioning.md). Read from the catalog, never from a setting, by everything that must tell them
apart: ``outbox db check`` (celery_outbox/migrate.py), retention and the partition commands (ops/).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox.db import is_postgres
from celery_outbox.schema import Tables


def is_partitioned(session: Session | sa.Connection, *, tables: Tables) -> bool:
    """True when the outbox table is a partitioned table (Postgres only; False on SQLite)."""
    if not is_postgres(session):
        return False
    kind = session.execute(sa.text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:t)"),
                           {"t": tables.table(tables.outbox).name}).scalar()
    return kind == "p"
