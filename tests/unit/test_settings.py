"""Bad configuration is a clear error naming the variable; good configuration round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest

from celery_outbox import Settings as LibrarySettings
from celery_outbox.errors import ConfigError
from celeryconfig import DEFAULT_ROUTES, Settings, celery_config


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


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"relay_batch_size": 0}, "OUTBOX_RELAY_BATCH_SIZE must be > 0"),
        ({"relay_poll_interval_s": -1.0}, "POLL_INTERVAL"),
        ({"database_url": "mysql://x"}, "sqlite:// or postgresql://"),
        ({"broker_url": "kafka://x"}, "OUTBOX_BROKER_URL"),
        ({"relay_confirm_mode": "maybe"}, "CONFIRM_MODE"),
        ({"namespace": "a b"}, "NAMESPACE"),
        ({"table_prefix": "Bad-Prefix"}, "table prefix"),
        ({"worker_concurrency": 0}, "OUTBOX_WORKER_CONCURRENCY must be > 0"),
    ],
)
def test_bad_settings_are_refused_at_construction(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Settings(**kwargs)  # type: ignore[arg-type]


def test_settings_changed_by_replace_are_validated_again() -> None:
    with pytest.raises(ConfigError, match="OUTBOX_RELAY_BATCH_SIZE must be > 0"):
        Settings().replace(relay_batch_size=0)


def test_the_embedded_broker_is_the_deployment_s_alias_not_the_library_s() -> None:
    assert Settings(broker_url="embedded").broker_url == "embedded"
    with pytest.raises(ConfigError, match="OUTBOX_BROKER_URL"):
        LibrarySettings(broker_url="embedded")
    lib = LibrarySettings.from_env({})
    assert dict(lib.routes) == {} and lib.broker_url == ""
    with pytest.raises(ConfigError, match="no database"):
        _ = lib.effective_database_url


def test_celery_speaks_json_only() -> None:
    conf = celery_config(Settings(), "redis://127.0.0.1:6379/0")
    assert conf["accept_content"] == ["json"]
    assert conf["task_serializer"] == conf["result_serializer"] == conf["event_serializer"] == "json"
    assert conf["task_acks_late"] is True and conf["worker_prefetch_multiplier"] == 1


def test_redis_redelivery_follows_the_visibility_timeout() -> None:
    # (a retry may wait at most backoff_max, which must stay below the visibility timeout: validated at construction)
    settings = Settings(broker_visibility_timeout_s=30, consumer_retry_backoff_max_s=20)
    conf = celery_config(settings, "redis://127.0.0.1:6379/0")
    opts = conf["broker_transport_options"]
    assert opts["visibility_timeout"] == 30
    # a worker killed while holding kombu's restore mutex must not block restores for 5 minutes
    assert opts["unacked_mutex_expire"] == 60 and opts["unacked_restore_interval"] == 10


def test_retry_backoff_must_stay_below_the_visibility_timeout() -> None:
    with pytest.raises(ConfigError, match="must be below OUTBOX_BROKER_VISIBILITY_TIMEOUT_S"):
        Settings.from_env({"OUTBOX_BROKER_VISIBILITY_TIMEOUT_S": "60", "OUTBOX_CONSUMER_RETRY_BACKOFF_MAX_S": "60"})
    with pytest.raises(ConfigError, match="must be below OUTBOX_BROKER_VISIBILITY_TIMEOUT_S"):
        Settings(broker_visibility_timeout_s=60, consumer_retry_backoff_max_s=60)


def test_to_env_round_trips_every_field() -> None:
    s = Settings(home=Path("/tmp/h"), database_url="sqlite:////tmp/x.db", broker_url="redis://h:1/0",
                 routes={"A": ("x", "y"), "B": ("z",)}, relay_batch_size=7, relay_poll_interval_s=0.25,
                 admin_token="t", crash_points="after_mark@2")
    assert Settings.from_env(s.to_env()) == s
