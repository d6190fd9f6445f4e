"""Which ``Outbox`` the ``outbox`` command runs on: found in the user's project, never assumed.

The first of these that is given wins (docs/operations.md, "Which app the command uses"):

1. ``-A MODULE[:ATTR]`` on the command line;
2. the ``OUTBOX_APP`` environment variable (same form);
3. ``app = "MODULE[:ATTR]"`` in the ``[tool.celery-outbox]`` table of the nearest ``pyproject.toml``
   (the current directory, then its parents; the nearest file decides, with or without the table);
4. ``DJANGO_SETTINGS_MODULE``: Django is set up and the project's ``DjangoOutbox`` is used;
5. ``FLASK_APP``: the Flask app is loaded and the ``Outbox`` its ``FlaskOutbox.init_app`` built is used.

With none of them the command exits 2 with one line saying what to pass.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from celery_outbox.config.masking import bounded_repr
from celery_outbox.errors import EXTRAS, ConfigError, OutboxError, missing_extra
from celery_outbox.outbox import Outbox

APP_ENV = "OUTBOX_APP"
PYPROJECT_TABLE = "celery-outbox"  # [tool.celery-outbox]
DJANGO_APP_LABEL = "celery_outbox"  # the label of celery_outbox.contrib.django's AppConfig
NO_APP = ("no app: pass -A MODULE[:ATTR] (where your Outbox lives), set OUTBOX_APP, add "
          '[tool.celery-outbox] app = "MODULE[:ATTR]" to your pyproject.toml, or set DJANGO_SETTINGS_MODULE or FLASK_APP')

Kind = Literal["module", "django", "flask"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AppSource:
    """Where the Outbox is: ``spec`` (``MODULE[:ATTR]``, a settings module or a ``FLASK_APP`` value), how to load
    it, ``origin`` (what the user set, for messages) and the directory the project's modules import from."""

    kind: Kind
    spec: str
    origin: str
    root: Path


def nearest_pyproject(start: Path) -> Path | None:
    """The first ``pyproject.toml`` in ``start`` or one of its parents."""
    for directory in (start, *start.parents):
        candidate = directory / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def pyproject_app(path: Path) -> str | None:
    """``[tool.celery-outbox] app`` of ``path``; None when the table or the key is absent."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it as TOML ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    tool = data.get("tool")
    table = tool.get(PYPROJECT_TABLE) if isinstance(tool, dict) else None
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.{PYPROJECT_TABLE}] must be a table")
    app = table.get("app")
    if app is None:
        return None
    if not isinstance(app, str) or not app.strip():
        raise ConfigError(f'{path}: [tool.{PYPROJECT_TABLE}] app must be a string like "proj.outbox:outbox"')
    return app.strip()


def find_app(given: str | None, *, environ: Mapping[str, str], cwd: Path) -> AppSource:
    """The first source in the documented order; ``ConfigError`` (``NO_APP``) when there is none."""
    if given is not None:  # `-A ""` (an unset shell variable) is a bad -A, never a fall through to another source
        return AppSource(kind="module", spec=given, origin="-A", root=cwd)
    if environ.get(APP_ENV, "").strip():
        return AppSource(kind="module", spec=environ[APP_ENV].strip(), origin=APP_ENV, root=cwd)
    pyproject = nearest_pyproject(cwd)
    if pyproject is not None:
        app = pyproject_app(pyproject)
        if app is not None:
            return AppSource(kind="module", spec=app, origin=f"[tool.{PYPROJECT_TABLE}] app in {pyproject}",
                             root=pyproject.parent)
    if environ.get("DJANGO_SETTINGS_MODULE", "").strip():
        return AppSource(kind="django", spec=environ["DJANGO_SETTINGS_MODULE"].strip(), origin="DJANGO_SETTINGS_MODULE",
                         root=cwd)
    if environ.get("FLASK_APP", "").strip():
        return AppSource(kind="flask", spec=environ["FLASK_APP"].strip(), origin="FLASK_APP", root=cwd)
    raise ConfigError(NO_APP)


def _cwd() -> Path:
    """The current directory; one removed under the shell (a deploy replaced it) is one line saying so, exit 1: the
    command could not run where it was started, nothing the user typed was wrong."""
    try:
        return Path.cwd()
    except FileNotFoundError:
        raise OutboxError("the current directory no longer exists (removed since the shell entered it); "
                          "cd into your project's directory") from None


def _on_path(root: Path) -> None:
    """Like ``celery -A``: the project's modules import from its directory, not from an installed package."""
    entry = str(root)
    if entry not in sys.path and not (root == _cwd() and "" in sys.path):
        sys.path.insert(0, entry)


def _said(spec: str, origin: str) -> str:
    """Where the app was named, as an error names it: ``-A 'proj'``, ``OUTBOX_APP='proj'``, ``FLASK_APP ('app')``."""
    return f"{origin} {spec!r}" if origin == "-A" else f"{origin}={spec!r}" if origin == APP_ENV else f"{origin} ({spec!r})"


def load_outbox(spec: str, *, origin: str = "-A") -> Outbox:
    """``module`` or ``module:attr`` -> the ``Outbox`` there (an attribute named outbox, or the only one)."""
    module_name, _, attr = spec.partition(":")
    said = _said(spec, origin)
    # judged by its form before anything is imported: `-A amqp://u:pw@h//` is a URL typed for the app, not the
    # attribute "//u:pw@h//" of the module "amqp" (an error naming that attribute showed the password)
    if (not module_name or not all(part.isidentifier() for part in module_name.split("."))
            or (attr and not attr.isidentifier())):
        raise ConfigError(f"{said} is not MODULE[:ATTR]")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top in EXTRAS:
            raise ConfigError(f"{said}: {missing_extra(e.name, needed_by=spec)}") from None
        if top != module_name.split(".")[0]:
            raise ConfigError(f"{said}: {spec} imports {e.name!r}, which is not installed") from None
        raise ConfigError(f"{said}: cannot import {e.name!r}; run from your project's directory") from None
    if attr:
        found = getattr(module, attr, None)
        if not isinstance(found, Outbox):
            raise ConfigError(f"{said}: {attr!r} is not an Outbox")
        return found
    named = getattr(module, "outbox", None)
    if isinstance(named, Outbox):
        return named
    candidates = [v for v in vars(module).values() if isinstance(v, Outbox)]
    if len(candidates) != 1:
        raise ConfigError(f"{said}: found {len(candidates)} Outbox objects in {module_name}; name one as MODULE:ATTR")
    return candidates[0]


def _django_outbox(source: AppSource) -> Outbox:
    try:
        import django
    except ModuleNotFoundError:
        raise ConfigError('DJANGO_SETTINGS_MODULE is set but Django is not installed: pip install "celery-outbox[django]"') \
            from None
    from django.core.exceptions import ImproperlyConfigured

    try:
        django.setup()
    except ModuleNotFoundError as e:
        raise ConfigError(f"DJANGO_SETTINGS_MODULE={source.spec!r}: cannot import {e.name!r}; "
                          "run from your project's directory") from None
    except ImproperlyConfigured as e:
        reason = str(e).splitlines()[0] if str(e) else "improperly configured"
        raise ConfigError(f"DJANGO_SETTINGS_MODULE={source.spec!r}: {reason}") from None
    from django.apps import apps

    # The Django app of celery_outbox.contrib.django answers (its AppConfig), so the command names no
    # contrib module: contrib plugs into Django from above and Django's registry finds it.
    try:
        config = apps.get_app_config(DJANGO_APP_LABEL)
    except LookupError:
        raise ConfigError(f"DJANGO_SETTINGS_MODULE={source.spec!r}: add \"celery_outbox.contrib.django\" to "
                          "INSTALLED_APPS") from None
    outbox: Outbox = config.project_outbox()
    return outbox


def _flask_outbox(source: AppSource) -> tuple[Outbox, Any]:
    try:
        from flask.cli import NoAppException, ScriptInfo
    except ModuleNotFoundError:
        raise ConfigError('FLASK_APP is set but Flask is not installed: pip install "celery-outbox[flask]"') from None
    try:
        app = ScriptInfo(app_import_path=source.spec, set_debug_flag=False).load_app()
    except NoAppException as e:
        raise ConfigError(f"FLASK_APP={source.spec!r}: {str(e.format_message()).splitlines()[0]}") from None
    # FlaskOutbox.init_app keeps the app's Outbox in app.extensions, the registry Flask gives extensions
    found = [v for v in app.extensions.values() if isinstance(v, Outbox)]
    if len(found) != 1:
        raise ConfigError(f"FLASK_APP={source.spec!r}: the app has no Outbox (call FlaskOutbox().init_app(app) in it)")
    return found[0], app


def load_app(source: AppSource) -> tuple[Outbox, Any]:
    """The ``Outbox`` of ``source``, and the Flask app to run the command in (None for the others).

    The user's module (or settings, or Flask app) may call ``sys.exit`` while it loads: that is a bad app to
    load, one ``ConfigError`` line (exit 2), never the module's own exit status, nor exit 0 for a command that
    never ran. An exit of ``exit_on_config_error`` passes: it has already said why, in one line."""
    _on_path(source.root)
    try:
        if source.kind == "django":
            return _django_outbox(source), None
        if source.kind == "flask":
            return _flask_outbox(source)
        return load_outbox(source.spec, origin=source.origin), None
    except SystemExit as e:
        if isinstance(e.__context__, ConfigError) and e.__suppress_context__:
            raise
        raise ConfigError(f"{_said(source.spec, source.origin)}: loading it called sys.exit({bounded_repr(e.code)}) "
                          "instead of defining an Outbox") from None


def resolve(given: str | None, *, environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> tuple[Outbox, Any]:
    """``find_app`` then ``load_app``, on this process's environment and directory by default."""
    source = find_app(given, environ=os.environ if environ is None else environ, cwd=_cwd() if cwd is None else cwd)
    return load_app(source)
