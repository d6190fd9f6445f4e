"""``manage.py migrate`` gives the hot tables the autovacuum settings the library's Alembic revision co0007 gives
them (celery_outbox/autovacuum.py), records co0007, and migrating back resets them (real Postgres)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from django.core.management import call_command

from celery_outbox import autovacuum, migrate
from celery_outbox.db import make_engine
from celery_outbox.schema import define_tables

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def settings_of(url: str) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """(hot table -> its autovacuum reloptions, the options co0007 sets on this server)."""
    engine = make_engine(url)
    try:
        with engine.connect() as c:
            have = {t: dict(o.partition("=")[::2] for o in c.execute(sa.text(
                "SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = to_regclass(:t)"), {"t": t}).scalar_one())
                for t in autovacuum.hot_tables(define_tables(sa.MetaData()))}
            return have, autovacuum.options(autovacuum.server_version_num(c))
    finally:
        engine.dispose()


def test_django_migrate_sets_the_hot_tables_autovacuum_settings_and_back_resets_them(django_pg_url: str) -> None:
    # Given the session's database, created by Django's migrate only
    have, wanted = settings_of(django_pg_url)
    assert have == {t: wanted for t in have} and len(have) == 4
    assert migrate.current(django_pg_url) == migrate.head()
    try:
        # When the app is migrated back to before 0009, Then the settings are the server's again, co0006 recorded
        call_command("migrate", "celery_outbox", "0008_worker_registry", interactive=False, verbosity=0)
        have, _ = settings_of(django_pg_url)
        assert have == {t: {} for t in have}
        assert migrate.current(django_pg_url) == "co0006"
    finally:
        call_command("migrate", interactive=False, verbosity=0)
    # And forward again they are back
    have, wanted = settings_of(django_pg_url)
    assert have == {t: wanted for t in have} and migrate.current(django_pg_url) == migrate.head()
