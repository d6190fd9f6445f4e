"""The Outbox the Django admin replays through (``celery_outbox.contrib.django.use``): one per process, seen
by every thread, the last ``use()`` winning, kept in one declared module global (``REGISTRATION``), the only
mutable state of the module. No database: the registration never opens a session."""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_outbox import Outbox, Settings
from celery_outbox.contrib.django import dead_letters, use

# type(annotations): what `from __future__ import annotations` binds in a module
IMMUTABLE = (str, bytes, int, float, bool, type(None), tuple, frozenset, type(annotations))


def make_outbox() -> Outbox:
    return Outbox(Celery("registration", set_as_current=False), settings=Settings(database_url="sqlite://"))


@pytest.fixture
def restored() -> Iterator[None]:
    """The Outbox this process registered before (the example shop's DjangoOutbox) is back after the test
    (a test sender is not: the tests that set one forget it when done)."""
    outbox = dead_letters.registered()
    yield
    use(outbox)


def module_state(module: types.ModuleType) -> dict[str, Any]:
    """A module's globals that are neither modules, classes, functions nor immutable values."""
    return {name: value for name, value in vars(module).items()
            if not name.startswith("__") and not isinstance(value, (types.ModuleType, type, types.FunctionType,
                                                                    *IMMUTABLE))}


def test_the_registration_is_the_module_s_one_declared_global(restored: None) -> None:
    def send(consumer: str, envelope: Any) -> None:
        raise AssertionError("not called")

    # Given an Outbox and a test sender registered for the admin
    outbox = make_outbox()
    use(outbox, send=send)
    # Then the module's only mutable state is its declared registration, and the admin acts through it
    assert module_state(dead_letters) == {"REGISTRATION": dead_letters.registration()}
    assert dead_letters.configured() == (outbox, send)


def test_every_thread_sees_the_last_registration_and_use_none_forgets_it(restored: None) -> None:
    first, second = make_outbox(), make_outbox()
    # Given two registrations in this thread, the last one wins
    use(first)
    use(second)
    seen: list[Outbox | None] = []
    # When another thread (an admin request) asks, Then it sees the same one
    reader = threading.Thread(target=lambda: seen.append(dead_letters.registered()))
    reader.start()
    reader.join()
    assert seen == [second] and dead_letters.clock() is second.clock
    # And use(None) forgets the outbox and its sender for every thread
    use(second, send=lambda consumer, envelope: None)
    use(None)
    reader = threading.Thread(target=lambda: seen.append(dead_letters.registered()))
    reader.start()
    reader.join()
    assert seen == [second, None]
    use(second)
    assert dead_letters.configured() == (second, None)
