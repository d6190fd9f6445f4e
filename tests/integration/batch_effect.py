"""The batch test app's effect table (tests/integration/batch_app.py), importable without building the app."""

from __future__ import annotations

import sqlalchemy as sa

DOCS = sa.Table("batch_docs", sa.MetaData(), sa.Column("order_id", sa.String(64), primary_key=True),
                sa.Column("effects", sa.Integer, nullable=False))
BATCH_SIZE = 20
