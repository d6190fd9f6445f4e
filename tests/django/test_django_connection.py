"""``DjangoOutbox`` follows Django's connection: its settings come from settings.py, its sessions open on the
database Django's connection points at when they connect (the test database under a test runner), and no
pool of ours stops that database from being dropped.

Real Postgres; the database swap is the one Django's test runner makes (``create_test_db`` sets the
connection's ``settings_dict["NAME"]`` and ``settings.DATABASES``), done here by hand on a second database
migrated by Django's own ``migrate``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from celery import _state as celery_state
from django.conf import settings
from django.core.management import call_command
from django.db import connection, transaction
from django.test import override_settings

from celery_outbox import Event
from celery_outbox.contrib.django import DjangoOutbox, outbox_settings, publish, use
from celery_outbox.contrib.django.models import OutboxMessage
from celery_outbox.contrib.django.outbox import DjangoSessionSource
from celery_outbox.db import make_engine
from celery_outbox.errors import ConfigError
from celery_outbox.settings import Settings
from celery_outbox.testing import drain

PG_ADMIN_URL = os.environ.get("OUTBOX_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def restore_default_app() -> Iterator[None]:
    """``DjangoOutbox`` makes its app Celery's default and the admin's Outbox: put both back after the test."""
    saved = celery_state.default_app
    yield
    celery_state.set_default_app(saved)
    use(None)


def make_outbox(**overrides: Any) -> DjangoOutbox:
    app = Celery(f"t{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    outbox = DjangoOutbox(app, settings=Settings(namespace=f"dj{uuid.uuid4().hex[:8]}", **overrides))
    outbox.route("OrderPlaced", "elsewhere")
    return outbox


@pytest.fixture
def other_database(django_db_blocker: Any) -> Iterator[str]:
    """A second database migrated by Django (the "test database" the swap moves to); dropped WITHOUT FORCE."""
    name = f"outbox_swap_{uuid.uuid4().hex[:8]}"
    admin = make_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def swap_to(name: str) -> str:
    """What Django's ``create_test_db`` does to the connection; returns the old name."""
    old = str(connection.settings_dict["NAME"])
    connection.close()
    settings.DATABASES["default"]["NAME"] = name
    connection.settings_dict["NAME"] = name
    return old


def pending_types(url: str) -> list[str]:
    engine = make_engine(url)
    try:
        with engine.connect() as c:
            return list(c.exec_driver_sql("SELECT type FROM outbox_messages WHERE published_at_ms IS NULL")
                        .scalars())
    finally:
        engine.dispose()


def test_sessions_follow_djangos_connection_to_the_test_database_and_never_block_its_drop(
        restore_default_app: None, other_database: str, django_pg_url: str) -> None:
    # Given the project's outbox, built at import time while Django points at the "developer's" database
    outbox = make_outbox()
    before = outbox.sessions.url
    assert before.endswith("/" + str(connection.settings_dict["NAME"]))
    # When a test runner switches Django to its test database (migrated by Django's migrate) and a test
    # commits an event there
    old = swap_to(other_database)
    try:
        call_command("migrate", interactive=False, verbosity=0)
        with transaction.atomic():
            publish(Event("OrderPlaced", {"order_id": "o-1"}))
        # Then the relay of that same outbox reads the test database: it publishes the test's event
        [message] = drain(outbox).published
        assert message.consumer == "elsewhere" and outbox.sessions.url.endswith("/" + other_database)
        # and the developer's database never saw it
        assert OutboxMessage.objects.count() == 1
        assert pending_types(django_pg_url) == []
        # and no connection of ours is left open on the test database: a plain DROP DATABASE (what Django's
        # destroy_test_db runs, no FORCE) succeeds
        connection.close()
        admin = make_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as c:
                c.exec_driver_sql(f'DROP DATABASE "{other_database}"')
        finally:
            admin.dispose()
    finally:
        swap_to(old)
    # And back on the original database, the outbox follows again
    assert outbox.sessions.url == before


def test_the_pool_follows_conn_max_age_outside_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    from django.core import mail

    source = DjangoSessionSource(using="default", settings=Settings())
    # Under a test environment (pytest-django set one up): never a pool, whatever CONN_MAX_AGE says
    with override_settings():
        monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 60)
        assert isinstance(source().kw["bind"].pool, sa.pool.NullPool)
        # Outside it: CONN_MAX_AGE=60 is a pool recycling connections after 60 s, like Django's own
        monkeypatch.delattr(mail, "outbox")
        engine = source().kw["bind"]
        assert isinstance(engine.pool, sa.pool.QueuePool) and engine.pool._recycle == 60
        # and CONN_MAX_AGE=0 (Django's default: a connection per request) is no pool
        monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 0)
        assert isinstance(source().kw["bind"].pool, sa.pool.NullPool)
    source.dispose()


def test_settings_come_from_settings_py_over_the_environment() -> None:
    # Given an OUTBOX block and OUTBOX_* names in settings.py, and the environment
    environ = {"OUTBOX_RELAY_BATCH_SIZE": "7", "OUTBOX_NAMESPACE": "from-env", "OUTBOX_ADMIN_TOKEN": "x" * 20}
    with override_settings(OUTBOX={"consumer_max_deliveries": 5, "RELAY_MAX_ATTEMPTS": 4}, OUTBOX_NAMESPACE="from-settings",
                           OUTBOX_ENQUEUE_OUTSIDE_TRANSACTION="raise", OUTBOX_RELAY_POLL_INTERVAL_S="2.5"):
        s = outbox_settings(environ=environ)
    # Then settings.py wins over the environment, which wins over the defaults; text is parsed as env text is
    assert (s.namespace, s.relay_max_attempts, s.enqueue_outside_transaction) == ("from-settings", 4, "raise")
    assert s.consumer_max_deliveries == 5
    assert (s.relay_batch_size, s.admin_token, s.relay_poll_interval_s) == (7, "x" * 20, 2.5)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"OUTBOX": {"relay_batch_sise": 5}}, "settings.OUTBOX has an unknown key 'relay_batch_sise'"),
    ({"OUTBOX": ["namespace"]}, "settings.OUTBOX must be a dict"),
    ({"OUTBOX": {"namespace": "a"}}, "both set namespace"),  # the example's settings.py has OUTBOX_NAMESPACE
    ({"OUTBOX_RELAY_BATCH_SIZE": "many"}, "OUTBOX_RELAY_BATCH_SIZE must be int"),
    ({"OUTBOX_RELAY_BATCH_SIZE": 0}, "OUTBOX_RELAY_BATCH_SIZE must be > 0"),
    ({"OUTBOX_DATABASE_URL": "mysql://u:hunter2@db/x"}, "OUTBOX_DATABASE_URL must be sqlite:// or postgresql://"),
])
def test_a_bad_outbox_setting_is_one_clear_line(overrides: dict[str, Any], message: str) -> None:
    with override_settings(**overrides), pytest.raises(ConfigError) as e:
        outbox_settings(environ={})
    assert message in str(e.value) and "\n" not in str(e.value) and "hunter2" not in str(e.value)


def test_the_apps_own_tasks_get_late_acks_unless_the_project_chose(restore_default_app: None) -> None:
    from celery_outbox.celery.config import celery_config
    from celery_outbox.contrib.django.outbox import WORKER_DEFAULTS

    # Given a project app configured from settings.py, which chose prefetch 4 itself
    with override_settings(CELERY_WORKER_PREFETCH_MULTIPLIER=4, CELERY_BROKER_URL="memory://"):
        app = Celery(f"t{uuid.uuid4().hex[:6]}", set_as_current=False)
        app.config_from_object("django.conf:settings", namespace="CELERY")
        DjangoOutbox(app, settings=Settings(namespace=f"dj{uuid.uuid4().hex[:8]}"))
        conf = app.conf
        # Then a plain task of the app survives a killed worker (acked late, rejected on worker loss); task
        # events stay Celery's default, off (Flower turns them on); the project's own choice stays
        assert (conf.task_acks_late, conf.task_reject_on_worker_lost) == (True, True)
        assert (conf.worker_send_task_events, conf.task_send_sent_event) == (False, False)
        assert conf.worker_prefetch_multiplier == 4
    # and the values are the Flask path's
    flask_path = celery_config(Settings(), "memory://")
    assert {k: flask_path[k] for k in WORKER_DEFAULTS} == WORKER_DEFAULTS
