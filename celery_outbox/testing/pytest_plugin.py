"""Opt-in pytest fixtures: ``pytest_plugins = ["celery_outbox.testing.pytest_plugin"]`` in your conftest."""

from __future__ import annotations

import pytest

from celery_outbox.clock import ManualClock
from celery_outbox.testing.memory import InMemoryPublisher


@pytest.fixture
def outbox_publisher() -> InMemoryPublisher:
    """A broker stand-in that records what the relay published (and can be told to fail)."""
    return InMemoryPublisher()


@pytest.fixture
def manual_clock() -> ManualClock:
    """A clock your test moves with ``advance(ms)``: no sleeps, no wall time."""
    return ManualClock()
