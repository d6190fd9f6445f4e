"""Django on real Postgres, configured for tests/django only.

Django is configured here (``settings.configure``), not through DJANGO_SETTINGS_MODULE, so the
rest of the suite never sees it as a project. The settings are the example shop's own
(examples/django_shop/shop_project/settings.py) pointed at a fresh database of this test session,
created by Django's own ``migrate`` (the ``celery_outbox.contrib.django`` app's migrations and the
shop's), the way a Django project adopts the library. pytest-django's ``django_db_setup`` is replaced
so the database is a real one of this session. Tests use ``django_db(transaction=True)``: real commits,
like production, and every table is truncated before each test.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.db import make_engine, make_session_factory
from tests.services import require_service

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "django_shop"
PG_ADMIN_URL = os.environ.get("OUTBOX_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
DB_NAME = f"outbox_django_{uuid.uuid4().hex[:10]}"
DB_URL = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{DB_NAME}"


def _import_example_settings() -> Any:
    """Import the example's settings module (it builds no Celery app; ``shop_project.celery`` does)."""
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    import shop_project.settings as example_settings

    return example_settings


def _configure_django() -> None:
    import django
    from django.conf import settings

    from celery_outbox.contrib.django import database_settings

    if settings.configured:
        raise RuntimeError("Django is already configured; tests/django configures it itself "
                           "(unset DJANGO_SETTINGS_MODULE / --ds)")
    example = _import_example_settings()
    values = {name: getattr(example, name) for name in dir(example) if name.isupper()}
    values.update(
        DEBUG=False,
        DATABASES={"default": database_settings(DB_URL)},
        LOGGING_CONFIG=None,  # leave the rest of the suite's logging alone
        # Django 6's Tasks framework (ignored by Django 5.2): "outbox" is the library's backend
        # (tests/django/test_django_task_backend.py)
        TASKS={"default": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"},
               "outbox": {"BACKEND": "celery_outbox.contrib.django.task_backend.OutboxTaskBackend",
                          "QUEUES": ["default", "mail"]}},
    )
    settings.configure(**values)
    _without_leaks(django.setup)


def _without_leaks(fn: Any) -> None:
    """Run ``fn`` without leaking DJANGO_SETTINGS_MODULE or a current Celery app.

    ``django.setup()`` runs ShopConfig.ready(), which imports ``shop_project.celery`` (its Celery app
    and outbox, the Django way, which sets DJANGO_SETTINGS_MODULE); left in os.environ, every other
    Celery app in this process and every worker subprocess would load the shop as a Django project.
    """
    from celery import _state as celery_state

    saved_env = os.environ.get("DJANGO_SETTINGS_MODULE")
    saved_app = celery_state.get_current_app()
    try:
        fn()
    finally:
        if saved_env is None:
            os.environ.pop("DJANGO_SETTINGS_MODULE", None)
        else:
            os.environ["DJANGO_SETTINGS_MODULE"] = saved_env
        celery_state._set_current_app(saved_app)


_configure_django()


@pytest.fixture(scope="session")
def django_db_setup(django_db_blocker: Any) -> Iterator[None]:
    """The session's database: created here, migrated by ``manage.py migrate`` (Django), dropped at the end."""
    require_service("PostgreSQL", "127.0.0.1", 5432)
    admin = make_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{DB_NAME}"')
    try:
        from django.core.management import call_command

        with django_db_blocker.unblock():
            call_command("migrate", interactive=False, verbosity=0)
        yield
    finally:
        from django.db import connections

        with django_db_blocker.unblock():
            connections.close_all()
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')
        admin.dispose()


@pytest.fixture(scope="session")
def django_pg_url(django_db_setup: None) -> str:
    """The URL of the database Django uses, for SQLAlchemy-side code (the relay) in the same tests."""
    return DB_URL


@pytest.fixture(scope="session")
def sa_engine(django_pg_url: str) -> Iterator[sa.Engine]:
    engine = make_engine(django_pg_url)
    yield engine
    engine.dispose()


@pytest.fixture(autouse=True)
def _empty_tables(request: pytest.FixtureRequest) -> None:
    """Every table emptied before each database test (the schema stays)."""
    if request.node.get_closest_marker("django_db") is None:
        return
    engine: sa.Engine = request.getfixturevalue("sa_engine")
    with engine.begin() as c:
        tables = c.exec_driver_sql(
            "SELECT tablename FROM pg_tables WHERE schemaname='public' "
            "AND tablename NOT IN ('django_migrations', 'outbox_schema_version')"  # schema versions, not data
        ).scalars().all()
        if tables:
            c.exec_driver_sql("TRUNCATE " + ", ".join(f'"{t}"' for t in tables) + " RESTART IDENTITY CASCADE")


@pytest.fixture
def sa_sessions(sa_engine: sa.Engine) -> sessionmaker[Session]:
    """SQLAlchemy sessions on Django's database: what ``deliver`` uses for its bookkeeping."""
    return make_session_factory(sa_engine)


@pytest.fixture
def shop_outbox() -> Any:
    """The example project's ``Outbox`` (its consumers included by ShopConfig.ready())."""
    from shop_project.celery import outbox

    return outbox
