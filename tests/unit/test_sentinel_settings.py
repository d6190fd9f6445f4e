"""Redis behind Sentinel: a ``sentinel://`` broker URL is accepted and masked, and every kombu connection the
library opens (the Celery app, the relay's publisher, the readiness and queue probes) gets the master's
name, from the app's own ``broker_transport_options`` or ``OUTBOX_BROKER_SENTINEL_MASTER``."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from celery_outbox import Outbox
from celery_outbox.celery.config import celery_config, sentinel_options
from celery_outbox.celery.kombu_publisher import KombuPublisher
from celery_outbox.errors import ConfigError
from celery_outbox.settings import Settings

SENTINELS = "sentinel://:s3cret@127.0.0.1:26379/0;sentinel://:s3cret@127.0.0.1:26380/0"


def test_a_sentinel_url_with_its_master_is_accepted_and_its_password_never_shown() -> None:
    settings = Settings.from_env({"OUTBOX_BROKER_URL": SENTINELS, "OUTBOX_BROKER_SENTINEL_MASTER": "mymaster"})
    assert settings.broker_url == SENTINELS
    assert settings.broker_sentinel_master == "mymaster"
    assert settings.kind_of_broker(settings.broker_url) == "redis"
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings)


def test_a_sentinel_url_without_its_master_is_one_clean_error_naming_the_setting() -> None:
    settings = Settings.from_env({"OUTBOX_BROKER_URL": SENTINELS})
    with pytest.raises(ConfigError) as e:
        celery_config(settings, SENTINELS)
    assert "OUTBOX_BROKER_SENTINEL_MASTER" in str(e.value)
    assert "s3cret" not in str(e.value)


@pytest.mark.parametrize("bad", ["my master", "-x", "a/b", "x" * 65])
def test_a_malformed_master_name_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="OUTBOX_BROKER_SENTINEL_MASTER"):
        Settings.from_env({"OUTBOX_BROKER_URL": SENTINELS, "OUTBOX_BROKER_SENTINEL_MASTER": bad})


def test_the_celery_config_carries_the_master_with_the_redis_redelivery_options() -> None:
    settings = Settings(broker_url=SENTINELS, broker_sentinel_master="mymaster")
    options = celery_config(settings, SENTINELS)["broker_transport_options"]
    assert options["master_name"] == "mymaster"
    assert options["visibility_timeout"] == settings.broker_visibility_timeout_s


def test_the_relay_publisher_gets_the_master_and_socket_timeouts() -> None:
    settings = Settings(broker_url=SENTINELS, broker_sentinel_master="mymaster", routes={"E": ("a",)})
    options = KombuPublisher(broker_url=SENTINELS, settings=settings)._transport_options
    assert options["master_name"] == "mymaster"
    assert options["socket_timeout"] == settings.relay_publish_timeout_s


def test_the_apps_own_transport_options_win_over_the_setting() -> None:
    settings = Settings(broker_url=SENTINELS, broker_sentinel_master="fromenv")
    assert sentinel_options(settings, SENTINELS, {"master_name": "fromapp", "visibility_timeout": 5}) == {
        "master_name": "fromapp"}
    assert sentinel_options(settings, "redis://127.0.0.1:6379/0", {"master_name": "x"}) == {}


def test_an_app_on_sentinel_must_name_its_master_somewhere(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'o.db'}"
    app = Celery("s", set_as_current=False, broker=SENTINELS)
    with pytest.raises(ConfigError, match="master"):
        Outbox(app, settings=Settings(database_url=db))
    app = Celery("s", set_as_current=False, broker=SENTINELS)
    app.conf.broker_transport_options = {"master_name": "mymaster"}
    outbox = Outbox(app, settings=Settings(database_url=db))
    assert app.conf.broker_transport_options["master_name"] == "mymaster"
    assert app.conf.broker_transport_options["visibility_timeout"] == outbox.settings.broker_visibility_timeout_s
    outbox.close()


def test_quorum_queues_on_sentinel_are_refused() -> None:
    with pytest.raises(ConfigError, match="quorum"):
        celery_config(Settings(broker_url=SENTINELS, broker_sentinel_master="m", broker_queue_type="quorum"),
                      SENTINELS)
