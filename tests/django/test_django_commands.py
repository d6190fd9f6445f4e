"""``manage.py outbox ...`` (the library's click commands on the project's ``DjangoOutbox``) and the Django system
checks ``manage.py check`` runs (``celery_outbox.E001``-``E004``, ``W001``).

Real Postgres (the session's test database, created by Django's ``migrate``); the Celery app's broker is kombu's
in-memory transport, so ``relay --once`` really publishes.
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery
from celery import _state as celery_state
from django.core import checks
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError
from django.db import transaction
from django.test import override_settings
from kombu import Queue

from celery_outbox import Event, migrate
from celery_outbox.contrib.django import DjangoOutbox, publish, use
from celery_outbox.contrib.django.management.commands.outbox import Command
from celery_outbox.contrib.django.models import OutboxMessage
from celery_outbox.settings import Settings

pytestmark = [pytest.mark.postgres]


@pytest.fixture
def outbox() -> Iterator[DjangoOutbox]:
    """A ``DjangoOutbox`` on the test database (it registers itself, as proj/celery.py's would); forgotten after."""
    saved = celery_state.default_app
    app = Celery(f"t{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    built = DjangoOutbox(app, settings=Settings(namespace=f"dj{uuid.uuid4().hex[:8]}"))
    built.route("OrderPlaced", "elsewhere")
    yield built
    celery_state.set_default_app(saved)
    use(None)


def outbox_command(*args: str) -> tuple[int, str, str]:
    """``call_command("outbox", *args)``: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        call_command("outbox", *args, stdout=out, stderr=err)
    except CommandError as e:
        return e.returncode, out.getvalue(), err.getvalue()
    return 0, out.getvalue(), err.getvalue()


def from_command_line(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """What ``python manage.py outbox *args`` runs (``run_from_argv``): (exit code, stdout, stderr)."""
    code = 0
    try:
        Command().run_from_argv(["manage.py", "outbox", *args])
    except SystemExit as e:
        code = int(e.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def place_order(order_id: str) -> None:
    with transaction.atomic():
        publish(Event("OrderPlaced", {"order_id": order_id}))


def dead_letter(order_id: str) -> int:
    """An outbox row the relay gave up on, written through the ORM."""
    place_order(order_id)
    row = OutboxMessage.objects.get(payload__order_id=order_id)
    OutboxMessage.objects.filter(seq=row.seq).update(attempts=5, dead_lettered_at_ms=1, last_error="NotRoutable: nope")
    return int(row.seq)


# -- manage.py outbox ---------------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_stats_reads_the_database_djangos_connection_uses(outbox: DjangoOutbox) -> None:
    # Given one pending row written through the Django ORM on the test database
    place_order("o-1")
    # When `manage.py outbox stats --json` runs with no -A
    code, out, _err = outbox_command("stats", "--json")
    # Then it counts that row: the command is bound to the project's DjangoOutbox, on Django's database
    assert code == 0
    assert json.loads(out)["outbox"]["pending"] == 1


@pytest.mark.django_db(transaction=True)
def test_relay_once_publishes_the_pending_rows(outbox: DjangoOutbox) -> None:
    place_order("o-1")
    place_order("o-2")
    code, out, err = outbox_command("relay", "--once", "--no-listen")
    assert (code, err) == (0, "")
    assert out.startswith("published 2, failed 0, dead-lettered 0")
    assert OutboxMessage.objects.filter(published_at_ms__isnull=True).count() == 0


@pytest.mark.django_db(transaction=True)
def test_dead_letters_list_show_replay_purge(outbox: DjangoOutbox) -> None:
    # Given two dead-lettered outbox rows
    first, second = dead_letter("o-1"), dead_letter("o-2")
    # When they are listed and one is shown
    code, out, _ = outbox_command("dead-letters", "list", "--json")
    assert code == 0
    assert [d["id"] for d in json.loads(out)] == [f"outbox:{first}", f"outbox:{second}"]
    code, out, _ = outbox_command("dead-letters", "show", f"outbox:{first}")
    assert code == 0 and "NotRoutable: nope" in out and "o-1" in out
    # When the first is replayed and the second purged
    code, out, err = outbox_command("dead-letters", "replay", f"outbox:{first}")
    assert code == 0, err
    code, out, err = outbox_command("dead-letters", "purge", f"outbox:{second}", "--yes")
    assert code == 0, err
    # Then the first is pending again (due, a fresh attempt budget) and the second is gone
    row = OutboxMessage.objects.get(seq=first)
    assert (row.dead_lettered_at_ms, row.published_at_ms, row.attempts) == (None, None, 0)
    assert not OutboxMessage.objects.filter(seq=second).exists()
    # and a bad id exits with the outbox command's code and changes nothing
    code, _out, err = outbox_command("dead-letters", "replay", "outbox:999999")
    assert code != 0 and "999999" in err
    assert OutboxMessage.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_check_and_prune_from_the_command_line(outbox: DjangoOutbox, capsys: pytest.CaptureFixture[str]) -> None:
    # `python manage.py outbox check --no-broker`: the schema manage.py migrate created is ready
    code, out, err = from_command_line("check", "--no-broker", capsys=capsys)
    assert (code, out.strip(), err) == (0, "ready: database ok, schema ok", "")
    code, out, err = from_command_line("prune", "--published-older-than", "1d", "--json", capsys=capsys)
    assert code == 0, err
    assert json.loads(out)["outbox_deleted"] == 0


@contextmanager
def schema_version(revision: str | None) -> Iterator[None]:
    """The test database's ``outbox_schema_version`` set to ``revision`` (None: no row) and committed, as a
    database behind Django's migrations of the installed package would be; restored after."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT version_num FROM outbox_schema_version")
        saved = [row[0] for row in cursor.fetchall()]
        cursor.execute("DELETE FROM outbox_schema_version")
        if revision is not None:
            cursor.execute("INSERT INTO outbox_schema_version (version_num) VALUES (%s)", [revision])
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM outbox_schema_version")
            for value in saved:
                cursor.execute("INSERT INTO outbox_schema_version (version_num) VALUES (%s)", [value])


def current_revision() -> list[str]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT version_num FROM outbox_schema_version")
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.django_db(transaction=True)
def test_db_upgrade_refuses_tables_djangos_migrations_own(outbox: DjangoOutbox,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Given a project that installs celery_outbox.contrib.django, its database a revision behind the library's,
    When the user runs `manage.py outbox db upgrade` (the Flask and plain-SQLAlchemy habit),
    Then it is refused, exit 2 with one line naming `python manage.py migrate`, and Alembic changed nothing:
    tables it made first would make Django's `migrate` fail on a table that already exists."""
    previous = migrate.revisions()[-2]
    with schema_version(previous):
        code, out, err = from_command_line("--skip-checks", "db", "upgrade", capsys=capsys)
        assert (code, out) == (2, ""), err
        assert err.count("\n") == 1 and "run `python manage.py migrate`" in err, err
        assert current_revision() == [previous]


@pytest.mark.django_db(transaction=True)
def test_a_missing_schema_names_manage_py_migrate(outbox: DjangoOutbox, capsys: pytest.CaptureFixture[str]) -> None:
    """Given a project that installs celery_outbox.contrib.django and a database with no schema revision,
    When `manage.py outbox db current` and `check` say what to do,
    Then they name `python manage.py migrate`, the command that makes this project's tables, not `outbox db upgrade`."""
    with schema_version(None):
        code, out, err = from_command_line("--skip-checks", "db", "current", capsys=capsys)
        assert (code, out.strip()) == (0, "empty (the outbox tables are missing: run `python manage.py migrate`)"), err
        code, out, err = from_command_line("--skip-checks", "check", "--no-broker", "--json", capsys=capsys)
        assert code == 3, err
        [schema] = [c for c in json.loads(out)["checks"] if c["name"] == "schema"]
        assert schema["detail"] == "no outbox_schema_version revision: run 'python manage.py migrate'", schema


def test_help_and_usage_errors_are_the_outbox_commands(capsys: pytest.CaptureFixture[str]) -> None:
    # Given no Outbox at all: help and a mistyped command name need none
    use(None)
    with override_settings(OUTBOX_INSTANCE=None):
        code, out, _ = from_command_line("--help", capsys=capsys)
        assert code == 0
        assert out.startswith("Usage: manage.py outbox [OPTIONS] COMMAND [ARGS]...")
        for command in ("relay", "dead-letters", "stats", "check", "prune"):
            assert f"  {command} " in out
        code, _, err = from_command_line("--skip-checks", "relya", capsys=capsys)
        assert code == 2 and "No such command 'relya'" in err


def test_a_process_without_an_outbox_is_told_how_to_bind_one(capsys: pytest.CaptureFixture[str]) -> None:
    # Given no DjangoOutbox built in this process and no OUTBOX_INSTANCE
    use(None)
    with override_settings(OUTBOX_INSTANCE=None):
        code, out, err = from_command_line("--skip-checks", "stats", capsys=capsys)
    # Then one line names the fixes, exit 2 (a configuration error), no traceback
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "built no DjangoOutbox" in err and "OUTBOX_INSTANCE" in err and "-A proj.celery" in err


# -- system checks ------------------------------------------------------------------------------------------

def noop() -> None:
    """A task body."""


def outbox_issues() -> list[checks.CheckMessage]:
    issues: list[checks.CheckMessage] = checks.run_checks(tags=["celery_outbox"])
    return issues


def ids(issues: list[checks.CheckMessage]) -> list[str]:
    return sorted(str(i.id) for i in issues)


def test_checks_pass_for_a_correct_project(outbox: DjangoOutbox) -> None:
    assert outbox_issues() == []


def test_an_unknown_outbox_setting_is_reported_with_the_likely_name() -> None:
    # Given a typo in settings.py (silently ignored otherwise)
    with override_settings(OUTBOX_RELAY_BACH_SIZE=50):
        issues = outbox_issues()
    # Then manage.py check names it and the setting it probably meant
    [issue] = [i for i in issues if i.id == "celery_outbox.E002"]
    assert "OUTBOX_RELAY_BACH_SIZE" in issue.msg and issue.hint == "did you mean OUTBOX_RELAY_BATCH_SIZE?"
    assert issue.is_serious()


def test_a_bad_setting_value_fails_manage_py_check() -> None:
    # Given a value the outbox cannot use, and an unknown key in the OUTBOX block
    with override_settings(OUTBOX_RELAY_BATCH_SIZE="lots"):
        [issue] = [i for i in outbox_issues() if i.id == "celery_outbox.E001"]
        assert "OUTBOX_RELAY_BATCH_SIZE" in issue.msg and "'lots'" in issue.msg
        # Then `manage.py check` fails with it
        with pytest.raises(SystemCheckError, match=r"celery_outbox\.E001"):
            call_command("check", stdout=io.StringIO(), stderr=io.StringIO())
    with override_settings(OUTBOX={"relay_batch_sise": 5}):
        [issue] = [i for i in outbox_issues() if i.id == "celery_outbox.E001"]
        assert "relay_batch_sise" in issue.msg


@pytest.mark.parametrize("django_setting", [
    {"OUTBOX": {"postgresql://app:pw-Never-Shown-9@db/app": 1}},  # a URL pasted as a key
    {"OUTBOX_NAMESPACE": "postgresql://app:pw-Never-Shown-9@db/app"},  # a URL pasted into the wrong setting
    {"OUTBOX_CRASH_POINTS": "after_mark@postgresql://app:pw-Never-Shown-9@db/app"},
])
def test_a_misplaced_password_is_never_in_a_check_message(django_setting: dict[str, Any]) -> None:
    # Given a URL with a password where settings.py expects something else
    with override_settings(**django_setting):
        [issue] = [i for i in outbox_issues() if i.id == "celery_outbox.E001"]
    # Then manage.py check reports it, without the password
    assert "pw-Never-Shown" not in issue.msg and "***" in issue.msg, issue.msg


def test_a_route_to_an_unknown_consumer_is_reported(outbox: DjangoOutbox) -> None:
    # Given OUTBOX_ROUTES naming a consumer nobody declares (a worker of this app would refuse to start)
    outbox.settings = Settings(namespace=outbox.settings.namespace, routes={"OrderPlaced": ("ghost",)})
    [issue] = [i for i in outbox_issues() if i.id == "celery_outbox.E004"]
    assert "'ghost'" in issue.msg


def test_a_bad_outbox_instance_is_reported() -> None:
    use(None)
    with override_settings(OUTBOX_INSTANCE="shop_project.celery:nothing_here"):
        [issue] = outbox_issues()
    assert issue.id == "celery_outbox.E003" and "is not an Outbox" in issue.msg


def test_a_queue_no_worker_consumes_is_reported(outbox: DjangoOutbox) -> None:
    # Given tasks routed (by name, by a glob) to queues that are not in the app's task_queues
    app = outbox.app
    app.conf.task_routes = {"shop.send_mail": "emails", "shop.billing.*": {"queue": "billing"}}

    app.task(name="shop.send_mail")(noop)
    app.task(name="shop.billing.send_invoice")(noop)

    # Then each queue is a warning naming its task (a worker started without -Q never consumes it)
    issues = [i for i in outbox_issues() if i.id == "celery_outbox.W001"]
    assert [(i.obj, "shop.send_mail" in i.msg, "shop.billing.send_invoice" in i.msg) for i in issues] == [
        ("queue billing", False, True), ("queue emails", True, False)]
    assert not any(i.is_serious() for i in issues)
    # When the app declares them, the warnings go
    app.conf.task_queues = [*app.conf.task_queues, Queue("emails"), Queue("billing")]
    assert outbox_issues() == []
