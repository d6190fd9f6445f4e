"""``recommended_celery_config`` merges into an app a team already runs: its queues, default queue, routes and
result backend stay; the outbox's queues are added beside them; docs/settings.md lists every key it sets."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
from celery import Celery
from kombu import Exchange, Queue
from sqlalchemy.orm import Session

from celery_outbox import Envelope, Outbox, Settings, recommended_celery_config
from celery_outbox.celery.config import MERGED_KEYS, celery_config

SETTINGS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
BROKER = "redis://127.0.0.1:6379/9"


def team_app() -> Celery:
    """The app a team already runs: two queues, its own default queue, a result backend, its options."""
    app = Celery("team", broker="redis://127.0.0.1:6379/8", set_as_current=False)
    app.conf.update(
        task_queues=[Queue("celery", Exchange("celery"), routing_key="celery"),
                     Queue("reports", Exchange("reports"), routing_key="reports")],
        task_default_queue="reports", result_backend="redis://127.0.0.1:6379/7",
        broker_transport_options={"visibility_timeout": 7200, "global_keyprefix": "team:"},
        beat_schedule={"nightly": {"task": "team.report", "schedule": 86400.0}},
        task_routes={"team.report": {"queue": "reports"}},
    )
    return app


def add_outbox(app: Celery, namespace: str) -> Outbox:
    outbox = Outbox(app, settings=Settings.from_env({}, namespace=namespace, database_url="sqlite://"))

    @outbox.consumer("OrderPlaced", name="notify")
    def notify(session: Session, event: Envelope) -> None: ...

    return outbox


@pytest.mark.parametrize("order", ["config first", "outbox first"])
def test_merging_into_a_running_app_keeps_its_queues_default_queue_and_result_backend(order: str) -> None:
    # Given the team's app, When the recommended config and an Outbox are added (in either order)
    ns = f"m{uuid.uuid4().hex[:8]}"
    app = team_app()
    settings = Settings.from_env({}, namespace=ns)
    if order == "config first":
        app.conf.update(recommended_celery_config(settings))
        add_outbox(app, ns)
    else:
        add_outbox(app, ns)
        app.conf.update(recommended_celery_config(settings))
    conf = app.conf
    # Then its queues, default queue, routes, result backend and broker stay, and ours are added beside them
    names = [q.name for q in conf.task_queues]
    assert names[:2] == ["celery", "reports"] and {f"{ns}.notify", f"{ns}.relay"} <= set(names)
    assert conf.task_default_queue == "reports" and conf.result_backend == "redis://127.0.0.1:6379/7"
    assert conf.broker_url == "redis://127.0.0.1:6379/8"
    assert conf.task_routes["team.report"] == {"queue": "reports"}
    # And a worker started without -Q still consumes the team's queues
    assert {"celery", "reports"} <= set(app.amqp.queues)
    # And its transport options and beat entries win where they overlap, ours fill the rest
    assert conf.broker_transport_options["visibility_timeout"] == 7200
    assert conf.broker_transport_options["global_keyprefix"] == "team:"
    assert "unacked_restore_interval" in conf.broker_transport_options
    assert {"nightly", "drain-outbox"} <= set(conf.beat_schedule)
    # And the behaviour the guarantees rely on is on for the team's own tasks too
    assert conf.task_acks_late is True and conf.task_reject_on_worker_lost is True
    assert conf.worker_prefetch_multiplier == 1 and list(conf.accept_content) == ["json"]
    # And task events stay Celery's default, off (Flower turns them on in the workers it sees)
    assert conf.worker_send_task_events is False and conf.task_send_sent_event is False


@pytest.mark.parametrize("dedicated", [False, True])
def test_task_events_are_left_to_the_app_and_to_flower(dedicated: bool) -> None:
    # Given the configuration we recommend: it sets no task event key (three publishes per task in the
    # worker's parent and the broker; docs/operations.md, "Flower": Flower turns them on)
    settings = Settings.from_env({}, namespace=f"e{uuid.uuid4().hex[:8]}", database_url="sqlite://")
    config = recommended_celery_config(settings, BROKER, dedicated=dedicated)
    assert not {"worker_send_task_events", "task_send_sent_event"} & set(config)
    # When it is merged into an app that turned them on, and an Outbox is added
    app = team_app()
    app.conf.update(worker_send_task_events=True, task_send_sent_event=True)
    app.conf.update(config)
    Outbox(app, settings=settings)
    # Then the app's own choice stays; a fresh app keeps Celery's default (off)
    assert (app.conf.worker_send_task_events, app.conf.task_send_sent_event) == (True, True)
    fresh = Celery("fresh", set_as_current=False)
    fresh.conf.update(config)
    Outbox(fresh, settings=settings)
    assert (fresh.conf.worker_send_task_events, fresh.conf.task_send_sent_event) == (False, False)


def test_a_fresh_app_keeps_celerys_default_queue_consumed() -> None:
    # Given an app that declares no queues (Celery's implicit "celery" queue)
    ns = f"f{uuid.uuid4().hex[:8]}"
    app = Celery("fresh", set_as_current=False)
    app.conf.update(recommended_celery_config(Settings.from_env({}, namespace=ns), BROKER))
    add_outbox(app, ns)
    # Then "celery" is still the default queue, declared beside ours, and consumed by a worker without -Q
    assert app.conf.task_default_queue == "celery" and app.conf.broker_url == BROKER
    assert {"celery", f"{ns}.notify", f"{ns}.relay"} <= set(app.amqp.queues)


def test_the_merged_config_sets_only_behaviour_keys_and_dedicated_is_the_whole_config() -> None:
    settings = Settings.from_env({})
    merged = recommended_celery_config(settings, BROKER)
    assert set(merged) == {*MERGED_KEYS, "broker_url"}
    assert not {"task_queues", "task_default_queue", "result_backend", "task_routes", "broker_transport_options",
                "beat_schedule", "task_ignore_result"} & set(merged)
    assert "broker_url" not in recommended_celery_config(settings)  # the app's own broker stays
    assert recommended_celery_config(settings, BROKER, dedicated=True) == celery_config(settings, BROKER)


def test_the_settings_page_lists_every_key_it_sets() -> None:
    text = SETTINGS_PAGE.read_text()
    section = text[text.index("## Celery configuration\n"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    listed = set(re.findall(r"^\| `([a-z_]+)`", section, re.MULTILINE))
    settings = Settings.from_env({})
    every = set(recommended_celery_config(settings, BROKER)) | set(recommended_celery_config(
        settings, BROKER, dedicated=True, beat_schedule_filename="x"))
    assert every - listed == set() and listed - every == set()
