"""``celery_outbox.is_unique_violation`` on real constraint violations of every driver we support.

Each database raises its own error for the same five writes: a duplicate primary key and a duplicate
unique column (True), a NULL in a NOT NULL column, a missing foreign key and a failed CHECK (False).
psycopg2 names the SQLSTATE ``pgcode``, psycopg 3 ``sqlstate``, SQLite has no SQLSTATE at all.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from celery_outbox import is_unique_violation

DDL = (
    "CREATE TABLE uv_parent (id INTEGER PRIMARY KEY)",
    "CREATE TABLE uv_row (id INTEGER PRIMARY KEY, code TEXT UNIQUE, name TEXT NOT NULL, "
    "parent_id INTEGER REFERENCES uv_parent (id), qty INTEGER CHECK (qty > 0))",
    "INSERT INTO uv_row (id, code, name) VALUES (1, 'a', 'first')",
)

WRITES = {
    "duplicate primary key": ("INSERT INTO uv_row (id, code, name) VALUES (1, 'b', 'x')", True),
    "duplicate unique column": ("INSERT INTO uv_row (id, code, name) VALUES (2, 'a', 'x')", True),
    "null in not null": ("INSERT INTO uv_row (id, code, name) VALUES (3, 'c', NULL)", False),
    "missing foreign key": ("INSERT INTO uv_row (id, code, name, parent_id) VALUES (4, 'd', 'x', 99)", False),
    "failed check": ("INSERT INTO uv_row (id, code, name, qty) VALUES (5, 'e', 'x', 0)", False),
}


@pytest.fixture(params=["sqlite", "psycopg2", "psycopg"])
def connection(request: pytest.FixtureRequest) -> Iterator[sa.Connection]:
    """A connection with the two tables, on SQLite or on Postgres through psycopg2 or psycopg 3."""
    if request.param == "sqlite":
        engine = sa.create_engine(f"sqlite:///{request.getfixturevalue('tmp_path') / 'uv.db'}")
        sa.event.listen(engine, "connect", lambda dbapi, _rec: dbapi.execute("PRAGMA foreign_keys=ON"))
    else:
        url: str = request.getfixturevalue("pg_url")
        engine = sa.create_engine(f"postgresql+{request.param}://" + url.split("://", 1)[1])
    try:
        with engine.connect() as c:
            with c.begin():
                for statement in DDL:
                    c.exec_driver_sql(statement)
            try:
                yield c
            finally:
                c.rollback()
                with c.begin():
                    c.exec_driver_sql("DROP TABLE uv_row")
                    c.exec_driver_sql("DROP TABLE uv_parent")
    finally:
        engine.dispose()


@pytest.mark.parametrize("write", sorted(WRITES))
def test_only_a_unique_violation_is_one(connection: sa.Connection, write: str) -> None:
    statement, expected = WRITES[write]
    # Given a table holding row 1, When a write breaks one of its constraints
    with pytest.raises(sa.exc.IntegrityError) as caught, connection.begin():
        connection.exec_driver_sql(statement)
    # Then SQLAlchemy's error and the driver's own both say whether it was a unique violation
    assert is_unique_violation(caught.value) is expected
    assert caught.value.orig is not None
    assert is_unique_violation(caught.value.orig) is expected


def test_a_driver_error_wrapped_as_the_cause_is_read_through(connection: sa.Connection) -> None:
    # Given the driver's error raised again as the cause of another one (how Django wraps it)
    class WrappedIntegrityError(Exception):
        pass

    with pytest.raises(sa.exc.IntegrityError) as caught, connection.begin():
        connection.exec_driver_sql(WRITES["duplicate unique column"][0])
    with pytest.raises(WrappedIntegrityError) as wrapped:
        raise WrappedIntegrityError(str(caught.value.orig)) from caught.value.orig
    # Then the cause decides
    assert is_unique_violation(wrapped.value)


def test_an_error_that_is_no_constraint_violation_is_not_one() -> None:
    assert not is_unique_violation(ValueError("something else"))
