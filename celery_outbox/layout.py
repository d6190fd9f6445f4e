"""Which physical layout the outbox table has: the plain table, or the optional partitioned one
(docs/partitioning.md). Read from the catalog, never from a setting, by everything that must tell them
apart: ``outbox db check`` (celery_outbox/migrate.py), retention and the partition commands (ops/).
"""

from __future__ import annotations

from typing import Any

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


def expected_difference(diff: Any, *, tables: Tables) -> bool:
    """True for the two differences ``outbox db check`` sees on the partitioned layout by design: the parent
    holds neither the unique ``message_id`` constraint nor ``ux_<prefix>dedup`` (each partition does)."""
    if not isinstance(diff, tuple) or len(diff) < 2:
        return False
    kind, obj = diff[0], diff[1]
    table = getattr(getattr(obj, "table", None), "name", None)
    if table != tables.table(tables.outbox).name:
        return False
    if kind == "add_index":
        return bool(getattr(obj, "name", None) == f"ux_{tables.prefix}dedup")
    if kind == "add_constraint" and isinstance(obj, sa.UniqueConstraint):
        return [c.name for c in obj.columns] == ["message_id"]
    return False
