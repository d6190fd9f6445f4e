"""Redis behind Sentinel per test (chaos/sentinel.py): a primary, a replica and three sentinels from
Debian's redis-server, about 7 s to start (the sentinels find each other by their hello messages).

Without redis-server the tests skip with the reason (they fail under CI=true). A failover is
destructive, so each test gets a group of its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from chaos.sentinel import SentinelGroup, sentinel_missing
from tests.services import IN_CI


def started_group() -> Iterator[SentinelGroup]:
    """A started group, closed after (a fixture's body: ``yield from started_group()``)."""
    reason = sentinel_missing()
    if reason:
        if IN_CI:
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    with SentinelGroup() as group:
        yield group
