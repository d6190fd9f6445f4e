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


def test_redis_redelivery_follows_the_visibility_timeout() -> None:
    conf = celery_config(Settings(broker_visibility_timeout_s=30), "redis://127.0.0.1:6379/0")
    opts = conf["broker_transport_options"]
    assert opts["visibility_timeout"] == 30
    # a worker killed while holding kombu's restore mutex must not block restores for 5 minutes
    assert opts["unacked_mutex_expire"] == 60 and opts["unacked_restore_interval"] == 10


def test_retry_backoff_must_stay_below_the_visibility_timeout() -> None:
    with pytest.raises(ConfigError, match="must be below OUTBOX_BROKER_VISIBILITY_TIMEOUT_S"):
        Settings.from_env({"OUTBOX_BROKER_VISIBILITY_TIMEOUT_S": "60", "OUTBOX_CONSUMER_RETRY_BACKOFF_MAX_S": "60"})


def test_to_env_round_trips_every_field() -> None:
    s = Settings(home=Path("/tmp/h"), database_url="sqlite:////tmp/x.db", broker_url="redis://h:1/0",
                 routes={"A": ("x", "y"), "B": ("z",)}, relay_batch_size=7, relay_poll_interval_s=0.25,
                 admin_token="t", crash_points="after_mark@2")
    assert Settings.from_env(s.to_env()) == s
