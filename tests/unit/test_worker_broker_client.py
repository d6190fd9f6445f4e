"""A worker or beat whose broker needs a client that is not installed (``redis://`` without the ``[redis]`` extra)
stops before kombu imports its transport: one line naming the extra, not kombu's traceback naming none."""

from __future__ import annotations

import importlib.util
import uuid
from typing import Any

import pytest
from celery import Celery, signals

from celery_outbox import Outbox, Settings


def an_outbox(broker: str) -> Outbox:
    app = Celery(f"t{uuid.uuid4().hex[:6]}", broker=broker, set_as_current=False)
    return Outbox(app, settings=Settings(database_url="sqlite://", namespace=f"wb{uuid.uuid4().hex[:6]}"))


@pytest.fixture
def no_redis_client(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == "redis" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def worker_starts(app: Celery) -> None:
    """What ``celery worker`` and ``celery beat`` send before they resolve the broker's transport: the loader's
    ``init_worker`` imports the task modules (celery/loaders/base.py)."""
    signals.import_modules.send(sender=app)


def test_a_worker_on_redis_without_the_client_stops_with_one_line_naming_the_extra(no_redis_client: None) -> None:
    """Given an app on redis:// and no redis client installed, When its worker (or beat) starts,
    Then it exits with one line naming the [redis] extra: it was kombu's AttributeError traceback
    ('NoneType' object has no attribute 'Redis'), naming nothing to install."""
    outbox = an_outbox("redis://127.0.0.1:6379/0")
    try:
        with pytest.raises(SystemExit) as stopped:
            worker_starts(outbox.app)
        assert str(stopped.value.code) == ("Error: bad configuration: the redis:// broker needs 'redis', which is not "
                                           'installed: pip install "celery-outbox[redis]"')
    finally:
        outbox.close()


def test_another_apps_worker_and_a_broker_that_needs_no_client_start(no_redis_client: None) -> None:
    # Given an outbox on redis:// without its client, and another app's worker starting in the same process
    outbox = an_outbox("redis://127.0.0.1:6379/0")
    other = an_outbox("amqp://guest@127.0.0.1//")
    try:
        # Then neither that worker nor one on amqp:// (py-amqp comes with kombu) is stopped
        worker_starts(Celery("unrelated", broker="memory://", set_as_current=False))
        worker_starts(other.app)
    finally:
        outbox.close()
        other.close()
