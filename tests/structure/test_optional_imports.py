"""An optional dependency is needed only by the modules that use it, and its absence is one line naming the extra.

A project on RabbitMQ installed with ``[postgres,django]`` has no redis client: every module of the library
but the Redis-only paths must still import (Django's ``makemigrations`` imports the app's modules). The
modules that do need a dependency (``contrib.flask``: Flask, ``contrib.django``: Django) raise
``MissingExtraError``, whose message is one line with the ``pip install`` that fixes it.

``celery_outbox.errors.EXTRAS`` is the one map from a dependency's module to its extra; it is checked
against pyproject.toml's extras, so a new optional dependency cannot be added without its guard's map.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib import metadata as md
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from celery_outbox.errors import EXTRAS, MissingExtraError, missing_extra

ROOT = Path(__file__).resolve().parents[2]
# Extras that are not the library's runtime: the test toolchain and the profiler of bench/.
NOT_RUNTIME = {"dev", "bench", "demo"}
# Module prefixes that need a dependency to import at all; every other module must import without it.
NEEDS: dict[str, tuple[str, ...]] = {"flask": ("celery_outbox.contrib.flask",),
                                     "django": ("celery_outbox.contrib.django",)}

PROBE = r"""
import importlib, json, pkgutil, sys
hidden = sys.argv[1]
if hidden != "-":
    sys.modules[hidden] = None  # as if not installed: `import hidden` raises ModuleNotFoundError
import celery_outbox
from celery_outbox.errors import MissingExtraError
django_version = None
if hidden != "django":
    import django
    from django.conf import settings
    settings.configure(INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django.contrib.admin",
                                       "django.contrib.messages", "django.contrib.sessions", "celery_outbox.contrib.django"],
                       DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}})
    django.setup()
    django_version = django.VERSION[0]
results = {}
for m in pkgutil.walk_packages(celery_outbox.__path__, "celery_outbox.", onerror=lambda name: None):
    if ".migrations." in m.name or m.name.endswith(".migrations"):
        continue
    try:
        importlib.import_module(m.name)
        results[m.name] = ["ok", ""]
    except MissingExtraError as e:
        results[m.name] = ["missing-extra", str(e)]
    except BaseException as e:
        results[m.name] = ["error", f"{type(e).__name__}: {e}"]
print(json.dumps({"django": django_version, "results": results}))
"""


def probe(hidden: str) -> tuple[int | None, dict[str, list[str]]]:
    out = subprocess.run([sys.executable, "-c", PROBE, hidden], cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    return found["django"], found["results"]


def runtime_extras() -> dict[str, list[Requirement]]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in extras.items() if name not in NOT_RUNTIME}


def top_level_modules(dist: str) -> set[str]:
    wanted = canonicalize_name(dist)
    return {module for module, dists in md.packages_distributions().items()
            if wanted in {canonicalize_name(d) for d in dists} and module.isidentifier() and not module.startswith("_")}


def test_every_optional_dependency_of_an_extra_has_its_module_in_the_extras_map() -> None:
    # Given the runtime extras of pyproject.toml
    extras = runtime_extras()
    core = {canonicalize_name(Requirement(r).name)
            for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    for extra, requirements in extras.items():
        for req in requirements:
            if canonicalize_name(req.name) in core:
                continue  # a core dependency named for its own extra (kombu[redis]): nothing of ours imports it optionally
            modules = top_level_modules(req.name)
            # Then each distribution is installed here (the dev extra has them all) and each of its modules is mapped
            assert modules, f"[{extra}] {req.name} is not installed in this venv: cannot map it (pip install -e '.[dev]')"
            for module in modules:
                assert module in EXTRAS, f"[{extra}] installs {module!r}: add it to celery_outbox.errors.EXTRAS"
                # to an extra that really installs it
                named = EXTRAS[module]
                assert any(canonicalize_name(r.name) == canonicalize_name(req.name) for r in extras.get(named, [])), \
                    f"EXTRAS[{module!r}] = {named!r}, but [{named}] does not install {req.name}"


@pytest.mark.parametrize("hidden", sorted(EXTRAS))
def test_without_an_optional_dependency_only_the_modules_that_need_it_fail_in_one_line(hidden: str) -> None:
    # Given an interpreter where one optional dependency is not installed
    django_major, results = probe(hidden)
    assert len(results) > 50
    for module, (outcome, message) in sorted(results.items()):
        needs_it = any(module == p or module.startswith(p + ".") for p in NEEDS.get(hidden, ()))
        needs_django6 = module == "celery_outbox.contrib.django.task_backend" and django_major is not None \
            and django_major < 6
        if needs_it or needs_django6:
            # Then a module that needs it says so in one line, naming what to install
            assert outcome == "missing-extra", (module, outcome, message)
            assert "\n" not in message and "pip install " in message, message
            if needs_it:
                assert f'pip install "celery-outbox[{EXTRAS[hidden]}]"' in message, message
        else:
            # And every other module imports
            assert outcome == "ok", f"{module} does not import without {hidden!r}: {message}"


def test_the_missing_extra_message_is_one_line_naming_the_extra() -> None:
    error = missing_extra("redis.sentinel", needed_by="the sentinel:// broker")
    assert isinstance(error, MissingExtraError) and isinstance(error, ImportError)
    assert str(error) == "the sentinel:// broker needs 'redis.sentinel', which is not installed: " \
                         'pip install "celery-outbox[redis]"'
    assert error.name == "redis"


def test_every_extra_named_in_a_message_exists() -> None:
    assert set(EXTRAS.values()) <= set(runtime_extras()), set(EXTRAS.values()) - set(runtime_extras())


PROJECT = {
    "proj/__init__.py": "from proj.celery import app as celery_app\n",
    "proj/celery.py": (
        "import os\n"
        "from celery import Celery\n"
        "from celery_outbox.contrib.django import DjangoOutbox\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'proj.settings')\n"
        "app = Celery('proj')\n"
        "app.config_from_object('django.conf:settings', namespace='CELERY')\n"
        "outbox = DjangoOutbox(app)\n"),
    "proj/settings.py": (
        "SECRET_KEY = 'not-a-secret'\n"
        "INSTALLED_APPS = ['django.contrib.contenttypes', 'django.contrib.auth', 'celery_outbox.contrib.django', 'shop']\n"
        "DATABASES = {'default': {'ENGINE': 'django.db.backends.sqlite3', 'NAME': 'db.sqlite3'}}\n"
        "DEFAULT_AUTO_FIELD = 'django.db.models.BigAutoField'\n"
        "CELERY_BROKER_URL = OUTBOX_BROKER_URL = 'amqp://guest:guest@127.0.0.1:5672//'\n"),
    "shop/__init__.py": "",
    "shop/models.py": "from django.db import models\n\nclass Order(models.Model):\n    total = models.IntegerField()\n",
    "manage.py": (
        "import os, sys\n"
        "sys.modules['redis'] = None  # installed with [postgres,django]: no redis client\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'proj.settings')\n"
        "from django.core.management import execute_from_command_line\n"
        "execute_from_command_line(sys.argv)\n"),
}


def test_a_django_project_on_rabbitmq_without_redis_makes_its_migrations(tmp_path: Path) -> None:
    # Given Celery's usual Django layout on RabbitMQ, with no redis client installed
    for name, text in PROJECT.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    # When its first makemigrations and check run
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    for command in (["makemigrations", "shop"], ["check"]):
        out = subprocess.run([sys.executable, "manage.py", *command], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
        # Then both succeed
        assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "shop" / "migrations" / "0001_initial.py").exists()
