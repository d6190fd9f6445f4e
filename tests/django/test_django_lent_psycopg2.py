"""A SQLAlchemy engine on a lent psycopg2 connection (what a Django consumer's inbox and ordering statements run on
when Django's database is on psycopg2). SQLAlchemy's psycopg2 dialect registers its UUID adapter on every new
connection through psycopg2's C functions, which refuse a wrapper: every delivery failed with ``TypeError:
argument 2 must be a connection, cursor or None`` (found by ``make test-matrix-oldest``, psycopg2 alone; Django
picks psycopg 3 when both are installed, so .venv never took this path)."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy import pool

from celery_outbox.contrib.django.lent import Lent, _lent_url

# the matrix job with psycopg 3 alone (ci/matrix.sh newest) has no psycopg2 to lend
psycopg2 = pytest.importorskip("psycopg2", reason="psycopg2 is not installed (psycopg 3 alone)")
extras = pytest.importorskip("psycopg2.extras")

pytestmark = pytest.mark.postgres


def test_a_lent_psycopg2_connection_runs_statements_and_uuids(pg_url: str) -> None:
    # Given a real psycopg2 connection with the UUID adapter registered (as Django's psycopg2 backend does)
    extras.register_uuid()
    raw = psycopg2.connect(pg_url)
    try:
        # When SQLAlchemy borrows it through Lent, as the Django consumers' sessions do
        engine = sa.create_engine(_lent_url("postgresql+psycopg2://"), creator=lambda: Lent(raw),
                                  poolclass=pool.NullPool)
        value = uuid.uuid4()
        with engine.connect() as c:
            got = c.execute(sa.select(sa.cast(sa.literal(str(value)), sa.Uuid))).scalar_one()
        # Then the statement ran on it, and the dialect is psycopg2's (the library's driver checks hold)
        assert got == value and engine.dialect.driver == "psycopg2"
        engine.dispose()
    finally:
        raw.close()
