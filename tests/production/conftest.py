"""Fixtures of the production-shaped tests: a real PgBouncer in front of the local Postgres.

Locally a missing ``pgbouncer`` (Debian package ``pgbouncer``) or Postgres skips with the reason;
under CI=true it fails (``.ci/run`` installs the package).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.production.pgbouncer import PgBouncer, find_pgbouncer
from tests.services import IN_CI, require_service


def require_pgbouncer() -> str:
    exe = find_pgbouncer()
    if exe is None:
        reason = "pgbouncer is not installed (Debian package pgbouncer; .ci/run installs it)"
        if IN_CI:
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    return exe


@pytest.fixture
def pgbouncer() -> Iterator[PgBouncer]:
    """PgBouncer in transaction pooling mode on a free loopback port, in front of 127.0.0.1:5432."""
    require_service("PostgreSQL", "127.0.0.1", 5432)
    with PgBouncer(executable=require_pgbouncer()) as bouncer:
        yield bouncer
