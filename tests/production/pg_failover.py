"""A Postgres primary and streaming standby per test (chaos/pg_pair.py), started from Debian's binaries.

Without them the tests skip with the reason (they fail under CI=true, like every missing service). A
failover is destructive, so each test gets a pair of its own (about 2 s to start here).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from chaos.pg_pair import PgPair, postgres_missing
from tests.services import IN_CI


def started_pair() -> Iterator[PgPair]:
    """A started pair, closed after (a fixture's body: ``yield from started_pair()``)."""
    reason = postgres_missing()
    if reason:
        if IN_CI:
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    with PgPair() as pair:
        yield pair
