"""Bad configuration is a clear error naming the variable; good configuration round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest

from celeryconfig import DEFAULT_ROUTES, Settings, celery_config
from outbox.errors import ConfigError


def test_defaults_are_the_embedded_ones() -> None:
    s = Settings.from_env({})
    assert s.broker_url == "embedded"
    assert s.effective_database_url.startswith("sqlite:///")
    assert dict(s.routes) == DEFAULT_ROUTES


def test_values_are_parsed_from_the_environment() -> None:
    s = Settings.from_env({"OUTBOX_RELAY_BATCH_SIZE": "500", "OUTBOX_RELAY_POLL_INTERVAL_S": "0.2",
                           "OUTBOX_HOME": "/tmp/x", "OUTBOX_ROUTES": "A=x,y; B=z",
                           "OUTBOX_BROKER_URL": "amqp://guest:guest@localhost//"})
    assert s.relay_batch_size == 500 and s.relay_poll_interval_s == 0.2 and s.home == Path("/tmp/x")
    assert dict(s.routes) == {"A": ("x", "y"), "B": ("z",)}
    assert s.consumers == ("x", "y", "z")


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"OUTBOX_RELAY_BATCH_SIZE": "many"}, "OUTBOX_RELAY_BATCH_SIZE must be int"),
        ({"OUTBOX_RELAY_BATCH_SIZE": "0"}, "must be > 0"),
        ({"OUTBOX_RELAY_POLL_INTERVAL_S": "-1"}, "POLL_INTERVAL"),
        ({"OUTBOX_DATABASE_URL": "mysql://x"}, "sqlite:// or postgresql://"),
        ({"OUTBOX_BROKER_URL": "kafka://x"}, "OUTBOX_BROKER_URL"),
        ({"OUTBOX_ROUTES": "OrderPlaced"}, "OUTBOX_ROUTES"),
        ({"OUTBOX_RELAY_CONFIRM_MODE": "maybe"}, "CONFIRM_MODE"),
        ({"OUTBOX_NAMESPACE": "a b"}, "NAMESPACE"),
    ],
)
def test_bad_config_is_a_clear_error(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Settings.from_env(env)


def test_celery_speaks_json_only() -> None:
    conf = celery_config(Settings(), "redis://127.0.0.1:6379/0")
    assert conf["accept_content"] == ["json"]
    assert conf["task_serializer"] == conf["result_serializer"] == conf["event_serializer"] == "json"
    assert conf["task_acks_late"] is True and conf["worker_prefetch_multiplier"] == 1
