"""How the ``outbox`` command finds the user's Outbox: -A, OUTBOX_APP, [tool.celery-outbox] in the nearest
pyproject.toml, DJANGO_SETTINGS_MODULE, FLASK_APP, in that order; with none, exit 2 and one line saying what to
pass (docs/operations.md, "Which app the command uses"). Nothing points into this repository."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from celery_outbox.cli import cli
from celery_outbox.cli.app import NO_APP, find_app, load_outbox
from celery_outbox.config.masking import mask_secrets
from celery_outbox.errors import ConfigError

OUTBOX = str(Path(sys.executable).parent / "outbox")
FRAMEWORK_VARS = ("OUTBOX_APP", "DJANGO_SETTINGS_MODULE", "FLASK_APP")

# A user's module: an Outbox on a SQLite file and Celery's in-memory broker.
USER_APP = """
from celery import Celery
from celery_outbox import Outbox, Settings

app = Celery("{name}", broker="memory://")
outbox = Outbox(app, settings=Settings(database_url="sqlite:///{db}", namespace="{name}"))
"""


def user_env(**extra: str) -> dict[str, str]:
    """This process's environment without any app named and without the repository on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_") and k not in FRAMEWORK_VARS
           and k != "PYTHONPATH"}
    return {**env, **extra}


def write_app(directory: Path, module: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    db = directory / f"{module}.db"
    (directory / f"{module}.py").write_text(USER_APP.format(name=module, db=db))
    return db


def outbox(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([OUTBOX, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def no_app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in FRAMEWORK_VARS:
        monkeypatch.delenv(name, raising=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def test_with_no_app_named_the_command_exits_2_with_one_line_saying_what_to_pass(no_app: Path) -> None:
    # Given a directory with no pyproject.toml and no app variable, When a command needs the Outbox
    r = CliRunner().invoke(cli, ["stats"], catch_exceptions=False)
    # Then one line, exit 2, naming every way to say where the app is, and no traceback
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [f"Error: bad configuration: {NO_APP}"]
    assert "relay" not in r.output and "Traceback" not in r.output


def test_help_names_no_app_of_this_repository(no_app: Path) -> None:
    r = CliRunner().invoke(cli, ["--help"], catch_exceptions=False)
    assert r.exit_code == 0 and "relay.app" not in r.output
    assert "OUTBOX_APP" in r.output and "pyproject.toml" in r.output and "DJANGO_SETTINGS_MODULE" in r.output


def test_the_sources_are_taken_in_the_documented_order(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.celery-outbox]\napp = "from_toml:outbox"\n')
    sub = tmp_path / "src" / "deep"
    sub.mkdir(parents=True)
    everything = {"OUTBOX_APP": "from_env", "DJANGO_SETTINGS_MODULE": "proj.settings", "FLASK_APP": "shop:create_app()"}
    assert find_app("from_flag", environ=everything, cwd=sub).spec == "from_flag"
    assert find_app(None, environ=everything, cwd=sub).spec == "from_env"
    toml = find_app(None, environ={**everything, "OUTBOX_APP": ""}, cwd=sub)
    assert (toml.spec, toml.root) == ("from_toml:outbox", tmp_path)  # the project's root, found from a subdirectory
    only_frameworks = {"DJANGO_SETTINGS_MODULE": "proj.settings", "FLASK_APP": "shop:create_app()"}
    django = find_app(None, environ=only_frameworks, cwd=tmp_path.parent)
    assert (django.kind, django.spec) == ("django", "proj.settings")
    flask = find_app(None, environ={"FLASK_APP": "shop:create_app()"}, cwd=tmp_path.parent)
    assert (flask.kind, flask.spec) == ("flask", "shop:create_app()")
    with pytest.raises(ConfigError, match="no app: pass -A"):
        find_app(None, environ={}, cwd=tmp_path.parent)


def test_the_nearest_pyproject_decides_even_without_the_table(tmp_path: Path) -> None:
    # Given an outer project naming an app and an inner one (the user's) naming none
    (tmp_path / "pyproject.toml").write_text('[tool.celery-outbox]\napp = "outer"\n')
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "pyproject.toml").write_text('[project]\nname = "inner"\n')
    # Then the outer one's app is not used for the inner project
    with pytest.raises(ConfigError, match="no app"):
        find_app(None, environ={}, cwd=inner)


@pytest.mark.parametrize("text, words", [
    ('[tool.celery-outbox]\napp = 3\n', "app must be a string"),
    ('[tool.celery-outbox\n', "cannot read it as TOML"),
    ('[tool]\ncelery-outbox = "x"\n', "must be a table"),
])
def test_a_bad_pyproject_entry_is_one_clear_error(tmp_path: Path, text: str, words: str) -> None:
    (tmp_path / "pyproject.toml").write_text(text)
    with pytest.raises(ConfigError, match=words):
        find_app(None, environ={}, cwd=tmp_path)


def test_outbox_app_and_pyproject_find_a_users_module_outside_this_repository(tmp_path: Path) -> None:
    # Given a user's project in a temporary directory, the repository not on its path
    project = tmp_path / "project"
    write_app(project, "shop_outbox")
    (project / "pyproject.toml").write_text('[project]\nname = "shop"\n\n[tool.celery-outbox]\napp = "shop_outbox:outbox"\n')
    sub = project / "scripts"
    sub.mkdir()
    # When the commands run bare from a subdirectory (pyproject.toml), and with OUTBOX_APP from elsewhere
    up = outbox("db", "upgrade", cwd=sub, env=user_env())
    assert up.returncode == 0, up.stderr
    stats = outbox("stats", "--json", cwd=sub, env=user_env())
    # Then both reach the user's Outbox
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["outbox"]["pending"] == 0
    other = tmp_path / "other"
    write_app(other, "billing_outbox")
    r = outbox("db", "upgrade", cwd=other, env=user_env(OUTBOX_APP="billing_outbox"))
    assert r.returncode == 0, r.stderr
    assert (other / "billing_outbox.db").exists()
    # And an OUTBOX_APP that names nothing importable is one line naming the variable
    bad = outbox("stats", cwd=other, env=user_env(OUTBOX_APP="nowhere_at_all"))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "Error: bad configuration: OUTBOX_APP='nowhere_at_all': cannot import 'nowhere_at_all'; "
        "run from your project's directory"]


FLASK_APP_PY = """
from flask import Flask

from celery_outbox.contrib.flask import FlaskOutbox

outbox = FlaskOutbox()


def create_app():
    app = Flask("shop")
    app.config.update(OUTBOX_DATABASE_URL="sqlite:///{db}", CELERY={{"broker_url": "memory://"}})
    outbox.init_app(app)
    return app
"""


def test_flask_app_finds_the_flask_outbox(tmp_path: Path) -> None:
    pytest.importorskip("flask")
    project = tmp_path / "flaskproj"
    project.mkdir()
    db = project / "shop.db"
    (project / "shop.py").write_text(FLASK_APP_PY.format(db=db))
    r = outbox("db", "upgrade", cwd=project, env=user_env(FLASK_APP="shop:create_app()"))
    assert r.returncode == 0, r.stderr
    stats = outbox("stats", "--json", cwd=project, env=user_env(FLASK_APP="shop:create_app()"))
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["outbox"]["pending"] == 0 and db.exists()


DJANGO_SETTINGS = """
SECRET_KEY = "test"
INSTALLED_APPS = ["celery_outbox.contrib.django"]
DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": "{db}"}}}}
USE_TZ = True
CELERY_BROKER_URL = "memory://"
"""

DJANGO_CELERY = """
import os

from celery import Celery

from celery_outbox.contrib.django import DjangoOutbox

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
outbox = DjangoOutbox(app)
"""


def write_django_project(root: Path) -> Path:
    proj = root / "proj"
    proj.mkdir(parents=True)
    db = root / "db.sqlite3"
    (proj / "__init__.py").write_text("from .celery import app as celery_app\n\n__all__ = ['celery_app']\n")
    (proj / "settings.py").write_text(DJANGO_SETTINGS.format(db=db))
    (proj / "celery.py").write_text(DJANGO_CELERY)
    return db


def test_django_settings_module_finds_the_projects_django_outbox(tmp_path: Path) -> None:
    pytest.importorskip("django")
    project = tmp_path / "djproj"
    write_django_project(project)
    # the project's tables come from Django's migrate (the app is installed), as docs/django.md says
    r = subprocess.run([sys.executable, "-m", "django", "migrate"], cwd=project, capture_output=True, text=True,
                       env=user_env(DJANGO_SETTINGS_MODULE="proj.settings"), timeout=120)
    assert r.returncode == 0, r.stderr
    stats = outbox("stats", "--json", cwd=project, env=user_env(DJANGO_SETTINGS_MODULE="proj.settings"))
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["outbox"]["pending"] == 0


def test_manage_py_outbox_help_names_no_app_of_this_repository(tmp_path: Path) -> None:
    pytest.importorskip("django")
    project = tmp_path / "djproj"
    write_django_project(project)
    (project / "manage.py").write_text(textwrap.dedent("""
        import os, sys
        from django.core.management import execute_from_command_line
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
        execute_from_command_line(sys.argv)
    """))
    r = subprocess.run([sys.executable, "manage.py", "outbox", "--help"], cwd=project, env=user_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "-A, --app" in r.stdout and "relay.app" not in r.stdout


@pytest.mark.parametrize(("body", "words"), [
    ("import redis_is_hidden_here", "imports 'redis_is_hidden_here', which is not installed"),
    ("import redis", 'pip install "celery-outbox[redis]"'),
])
def test_an_app_whose_dependency_is_missing_is_one_line_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, words: str) -> None:
    # Given a user's module that imports a module this environment does not have (redis hidden here)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "redis", None)
    (tmp_path / "needs_dep_app.py").write_text(body + "\n")
    # When the command is pointed at it
    with pytest.raises(ConfigError) as raised:
        load_outbox("needs_dep_app")
    # Then one line names what is missing (and the extra that installs it, when it is one of ours)
    message = str(raised.value)
    assert words in message and "\n" not in message


@pytest.mark.parametrize(("source", "body", "shown"), [
    ("-A", "import sys\nsys.exit(3)", "sys.exit(3)"),
    ("-A", "import sys\nsys.exit(0)", "sys.exit(0)"),  # exit 0 with no command run would read as success
    ("-A", "raise SystemExit", "sys.exit(None)"),
    ("-A", "import sys\nsys.exit('postgresql://app:pw-exit-9@db/app')", "sys.exit('postgresql://app:***@db/app')"),
    ("FLASK_APP", "import sys\nsys.exit(4)", "sys.exit(4)"),
    ("DJANGO_SETTINGS_MODULE", "import sys\nsys.exit(5)", "sys.exit(5)"),
])
def test_an_app_that_exits_while_it_loads_is_one_line_and_exit_2(tmp_path: Path, source: str, body: str,
                                                                   shown: str) -> None:
    # Given a user's module that calls sys.exit when it is imported
    project = tmp_path / "project"
    project.mkdir()
    (project / "exits_app.py").write_text(body + "\n")
    # When the command is pointed at it (-A, or the framework variable)
    args, env = (["-A", "exits_app"], user_env()) if source == "-A" else ([], user_env(**{source: "exits_app"}))
    r = outbox(*args, "stats", cwd=project, env=env)
    # Then the CLI's own exit for a bad app (2), one line naming the exit, the module's status never passed on
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: bad configuration: ") and shown in lines[0], lines
    assert "pw-exit-9" not in r.stderr


def test_an_app_that_exits_on_a_bad_setting_keeps_its_one_line(tmp_path: Path) -> None:
    # Given a user's module that guards its settings with exit_on_config_error (it says why, then exits 2)
    project = tmp_path / "project"
    project.mkdir()
    (project / "guarded_app.py").write_text(
        "from celery_outbox import Settings, exit_on_config_error\n"
        "with exit_on_config_error():\n    Settings.from_env({'OUTBOX_ROUTES': 'A=x;A=y'})\n")
    r = outbox("-A", "guarded_app", "stats", cwd=project, env=user_env())
    # Then its own line stands alone, exit 2
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert r.stderr.startswith("bad configuration: OUTBOX_ROUTES")


@pytest.mark.parametrize("given", ["", " "])
def test_an_empty_dash_a_is_refused_not_passed_over(tmp_path: Path, given: str) -> None:
    # Given an app named in OUTBOX_APP, and `-A "$APP"` with APP unset (an empty -A)
    write_app(tmp_path, "env_app")
    r = outbox("-A", given, "stats", cwd=tmp_path, env=user_env(OUTBOX_APP="env_app"))
    # Then the empty -A is a bad -A, exit 2, not a command run on whatever app the next source names
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip() == f"Error: bad configuration: -A {given!r} is not MODULE[:ATTR]" and r.stdout == ""


def test_a_current_directory_removed_under_the_shell_is_one_line(tmp_path: Path) -> None:
    # Given a shell whose current directory was removed since it entered it (a deploy replaced the release)
    gone = tmp_path / "release"
    gone.mkdir()
    script = f"import os, subprocess, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); " \
             f"sys.exit(subprocess.run([{OUTBOX!r}, 'stats']).returncode)"
    r = subprocess.run([sys.executable, "-c", script], env=user_env(OUTBOX_APP="some_app"), capture_output=True,
                       text=True, timeout=120)
    # Then one line saying so, exit 1 (the command could not run there), not "unexpected FileNotFoundError"
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.strip() == ("Error: the current directory no longer exists (removed since the shell entered it); "
                                "cd into your project's directory")


def test_what_a_project_prints_while_it_loads_keeps_off_the_json(tmp_path: Path) -> None:
    # Given a user's module that prints a banner and binds a logging handler to stdout when it is imported
    project = tmp_path / "project"
    db = write_app(project, "chatty_app")
    (project / "chatty_app.py").write_text(
        "import logging, sys\nprint('starting chatty_app')\nlog = logging.getLogger('chatty')\n"
        "log.addHandler(logging.StreamHandler(sys.stdout))\nlog.warning('loaded')\n"
        + (project / "chatty_app.py").read_text())
    assert outbox("-A", "chatty_app", "db", "upgrade", cwd=project, env=user_env()).returncode == 0, db
    # When a machine asks for JSON
    r = outbox("-A", "chatty_app", "stats", "--json", cwd=project, env=user_env())
    # Then stdout is the one JSON document, and what the module printed went to stderr
    assert r.returncode == 0, r.stderr
    assert "pending" in json.loads(r.stdout)["outbox"]
    assert "starting chatty_app" in r.stderr and "loaded" in r.stderr


@pytest.mark.parametrize("spec", ["amqp://u:pw-app-77@h//", "redis://:pw-app-77@h:6379/0", "json://u:pw-app-77@h",
                                  "os:path.sep", "os: path"])
def test_an_app_that_is_not_module_attr_is_refused_by_its_form(spec: str) -> None:
    # Given a URL typed where the app goes (its scheme an importable module: py-amqp's amqp, the stdlib's json), or
    # an attribute that is no name
    # When the command loads it; Then one line refusing the form, before any import, without the password
    with pytest.raises(ConfigError) as raised:
        load_outbox(spec)
    message = mask_secrets(str(raised.value))  # as the CLI shows it (cli.common.one_line)
    assert message.endswith("is not MODULE[:ATTR]") and "pw-app-77" not in message, message


@pytest.mark.parametrize("args", [["db", "check"], ["db", "current"]])
def test_a_reader_that_stops_reading_is_no_error_of_ours(tmp_path: Path, args: list[str]) -> None:
    """Given a user's migrated app, When a command's stdout is a pipe nobody reads any more (`outbox db check |
    head -1` once head has its line), Then it exits as every click command does there, 1 and quiet: not an
    'unexpected BrokenPipeError' line asking for OUTBOX_TRACEBACK."""
    write_app(tmp_path, "pipe_outbox")
    env = user_env(OUTBOX_APP="pipe_outbox")
    assert outbox("db", "upgrade", cwd=tmp_path, env=env).returncode == 0
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes anything
    try:
        r = subprocess.run([OUTBOX, *args], cwd=tmp_path, env=env, stdout=write_end, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    finally:
        os.close(write_end)
    assert (r.returncode, r.stderr) == (1, "")


def test_a_relay_on_a_database_without_the_outbox_tables_says_what_to_run(tmp_path: Path) -> None:
    """Given a user's app whose database has no outbox tables yet (`outbox db upgrade` not run),
    When the standalone relay starts, Then it exits 1 with one line naming `outbox db upgrade`: it looped,
    logging a traceback of the missing table at every poll and never saying what to do."""
    write_app(tmp_path, "bare_outbox")
    try:
        r = subprocess.run([OUTBOX, "relay", "--no-listen", "--poll-interval", "0.05"], cwd=tmp_path,
                           env=user_env(OUTBOX_APP="bare_outbox"), capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the relay kept running on a database without its tables: {e.stderr!r:.2000}") from None
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines() == ["Error: the outbox tables are missing: run `outbox db upgrade`"], r.stderr
