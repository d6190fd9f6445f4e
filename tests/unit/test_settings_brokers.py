"""The Redis visibility-timeout rules apply on Redis only; with no broker in the settings the app's decides."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_outbox import Outbox
from celery_outbox import Settings as LibrarySettings
from celery_outbox.config.declare import BrokerRelation, broker_kind
from celery_outbox.errors import ConfigError
from celery_outbox.settings import LIBRARY_RELATIONS


def fast(broker_url: str = "", database_url: str = "") -> LibrarySettings:
    """Reconcile sooner than the visibility timeout, a time limit and a retry longer than it: wrong on Redis only."""
    return LibrarySettings(broker_url=broker_url, database_url=database_url, broker_visibility_timeout_s=60,
                           relay_reconcile_after_ms=30_000, consumer_time_limit_s=90, consumer_retry_backoff_max_s=90)

REDIS = "redis://127.0.0.1:6379/0"
RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"


def app(broker: str | None) -> Celery:
    return Celery("t", broker=broker, set_as_current=False)


@pytest.mark.parametrize("url", [RABBITMQ, "pyamqp://h//", "amqps://h//", "amqp://a//;amqp://b//", "memory://"])
def test_a_configuration_valid_off_redis_is_accepted(url: str) -> None:
    assert fast(url).relay_reconcile_after_ms == 30_000


@pytest.mark.parametrize("url", [REDIS, "rediss://h:6380/0", "redis://a:1/0;redis://b:1/0"])
def test_the_same_configuration_on_redis_is_refused_naming_every_rule(url: str) -> None:
    with pytest.raises(ConfigError) as e:
        fast(url)
    message = str(e.value)
    assert "\n" not in message
    for variable in ("OUTBOX_RELAY_RECONCILE_AFTER_MS", "OUTBOX_CONSUMER_TIME_LIMIT_S",
                     "OUTBOX_CONSUMER_RETRY_BACKOFF_MAX_S"):
        assert f"{variable} (" in message and "on Redis" in message


def test_with_no_broker_in_the_settings_the_celery_apps_broker_decides() -> None:
    # Given settings that name no broker (the Celery app's broker_url is used)
    settings = fast(database_url="sqlite://")
    # Then an Outbox on a RabbitMQ (or unset) app accepts them, and one on a Redis app refuses them at construction
    Outbox(app(RABBITMQ), settings=settings)
    Outbox(app(None), settings=settings)
    with pytest.raises(ConfigError, match=r"OUTBOX_RELAY_RECONCILE_AFTER_MS .* on Redis"):
        Outbox(app(REDIS), settings=settings)


def test_the_defaults_recover_in_well_under_a_minute_and_hold_on_redis() -> None:
    s = LibrarySettings(broker_url=REDIS)
    restore_interval = max(1, min(30, s.broker_visibility_timeout_s // 10))  # celery/config.py
    assert s.broker_visibility_timeout_s + 2 * restore_interval < 60  # a killed worker's messages (Redis)
    assert s.relay_reconcile_after_ms + s.relay_reconcile_interval_s * 1000 < 60_000  # a take-window loss
    assert s.relay_reconcile_after_ms > (s.broker_visibility_timeout_s + 2 * restore_interval) * 1000
    assert s.relay_reconcile_plain_tasks_after_ms >= 10 * s.relay_reconcile_after_ms  # a queued plain task is not re-sent


def test_only_the_visibility_timeout_rules_are_broker_specific() -> None:
    specific = {r.fields for r in LIBRARY_RELATIONS if isinstance(r, BrokerRelation)}
    assert specific == {("consumer_retry_backoff_max_s", "broker_visibility_timeout_s"),
                        ("consumer_time_limit_s", "broker_visibility_timeout_s"),
                        ("relay_reconcile_after_ms", "broker_visibility_timeout_s")}
    assert [broker_kind(u) for u in (REDIS, RABBITMQ, "", "memory://", "sentinel://h:1")] == [
        "redis", "rabbitmq", None, "memory", "redis"]


@pytest.mark.parametrize(("broker", "refused"), [(RABBITMQ, False), (REDIS, True)])
def test_a_consumer_retry_longer_than_the_visibility_timeout_is_refused_on_redis_only(broker: str,
                                                                                      refused: bool) -> None:
    # Given an app on `broker` and settings that name none
    outbox = Outbox(app(broker), settings=LibrarySettings(database_url="sqlite://", broker_visibility_timeout_s=60,
                                                          relay_reconcile_after_ms=90_000))

    def declare() -> None:
        @outbox.consumer("Thing", name="slow_retries", retry_backoff_max=120)
        def handle(session: object, envelope: object) -> None: ...

    # When a consumer asks for retries waiting longer than the visibility timeout
    # Then only Redis refuses it (its unacked messages come back after the timeout)
    if refused:
        with pytest.raises(ConfigError, match="VISIBILITY_TIMEOUT"):
            declare()
    else:
        declare()
