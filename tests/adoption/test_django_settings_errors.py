"""A bad ``OUTBOX_*`` value in a Django project laid out the documented way (tests/adoption/django_project:
``proj/__init__.py`` imports ``proj/celery.py``, which builds the ``DjangoOutbox`` while Django loads its
settings). Building the outbox never raises, so every ``manage.py`` command starts: ``manage.py check`` reports
the value as ``celery_outbox.E001`` (the setting, the value, what is allowed), and the first use of the outbox
(a ``.delay()``, the relay, ``manage.py outbox``) raises that same message.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.adoption import support

PROJECT = Path(__file__).resolve().parent / "django_project"
BAD = 'OUTBOX_RELAY_BATCH_SIZE = "lots"'
MESSAGE = "OUTBOX_RELAY_BATCH_SIZE must be int (> 0 and <= 10000, ASCII digits), got 'lots'"


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the adoption project whose settings.py has ``BAD``, on an in-memory broker."""
    here = tmp_path / "django_project"
    shutil.copytree(PROJECT, here, ignore=shutil.ignore_patterns("__pycache__", "*.sqlite3*"))
    settings = here / "proj" / "settings.py"
    settings.write_text(settings.read_text() + f"\n{BAD}\n")
    env = {"PATH": f"{support.BIN}:/usr/bin:/bin", "PYTHONPATH": str(here), "HOME": str(tmp_path),
           "SHOP_DB_PATH": str(tmp_path / "shop.sqlite3"), "SHOP_BROKER_URL": "memory://"}
    return here, env


def manage(project: tuple[Path, dict[str, str]], *args: str) -> subprocess.CompletedProcess[str]:
    here, env = project
    return subprocess.run([sys.executable, "manage.py", *args], cwd=here, env=env, capture_output=True, text=True,
                          timeout=120)


def test_manage_py_check_reports_the_bad_value_as_e001(project: tuple[Path, dict[str, str]]) -> None:
    # Given settings.py with OUTBOX_RELAY_BATCH_SIZE = "lots", When the team runs manage.py check
    out = manage(project, "check")
    # Then it fails as Django's system checks fail: the E001 line names the setting, the value, what is allowed
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert f"(celery_outbox.E001) the outbox settings are invalid: {MESSAGE}" in out.stderr


def test_the_first_use_raises_the_same_message(project: tuple[Path, dict[str, str]]) -> None:
    # Given the same project, When a shell (no system checks) sends a task in atomic() and starts a relay
    code = """
from django.db import transaction
from orders.tasks import confirm
from proj.celery import outbox
from celery_outbox import ConfigError
for what, use in (("delay", lambda: confirm.delay(1)), ("relay", outbox.relay_loop)):
    try:
        with transaction.atomic():
            use()
    except ConfigError as e:
        print(what, "refused:", e)
"""
    out = manage(project, "shell", "-c", code)
    # Then both are refused with the check's message
    assert out.returncode == 0, out.stderr
    refused = [line for line in out.stdout.splitlines() if " refused: " in line]
    assert refused == [f"delay refused: {MESSAGE}", f"relay refused: {MESSAGE}"]


def test_manage_py_outbox_is_one_line_and_exit_2(project: tuple[Path, dict[str, str]]) -> None:
    # When the relay is started without the checks, Then it is one line, the outbox command's config error
    out = manage(project, "outbox", "--skip-checks", "relay", "--once")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == f"Error: bad configuration: {MESSAGE}"
