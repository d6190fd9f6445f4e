"""Shared CLI plumbing: settings from the environment, errors as clear messages and exit codes."""

from __future__ import annotations

import functools
import importlib
import os
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from sqlalchemy import exc as sa_exc

from celery_outbox.errors import ConfigError, OutboxError
from celery_outbox.outbox import Outbox
from celery_outbox.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])


DEFAULT_APP = "relay.app"  # the reference deployment, when neither -A nor OUTBOX_APP names one


def settings_group(fn: Callable[..., None]) -> click.Group:
    @click.group(context_settings={"help_option_names": ["-h", "--help"]})
    @click.option("-A", "--app", "app_spec", envvar="OUTBOX_APP", default=None, metavar="MODULE[:ATTR]",
                  help="Where your Outbox lives, like celery -A (env OUTBOX_APP; default: the reference "
                       "deployment's relay.app).")
    @click.version_option(package_name="celery-outbox", prog_name="outbox")
    @click.pass_context
    @functools.wraps(fn)
    def group(ctx: click.Context, app_spec: str | None) -> None:
        ctx.ensure_object(dict)
        ctx.obj["app_spec"] = app_spec or DEFAULT_APP

    return group


def load_outbox(spec: str) -> Outbox:
    """``module`` or ``module:attr`` -> the ``Outbox`` there (an attribute named outbox, or the only one)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not all(part.isidentifier() for part in module_name.split(".")):
        raise ConfigError(f"-A {spec!r} is not MODULE[:ATTR]")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # like ``celery -A``: the project is the current directory, not an installed package
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"-A {spec!r}: cannot import {e.name!r}; run from your project's directory") from None
    if attr:
        found = getattr(module, attr, None)
        if not isinstance(found, Outbox):
            raise ConfigError(f"-A {spec!r}: {attr!r} is not an Outbox")
        return found
    named = getattr(module, "outbox", None)
    if isinstance(named, Outbox):
        return named
    candidates = [v for v in vars(module).values() if isinstance(v, Outbox)]
    if len(candidates) != 1:
        raise ConfigError(f"-A {spec!r}: found {len(candidates)} Outbox objects in {module_name}; "
                          "name one as MODULE:ATTR")
    return candidates[0]


def get_outbox(ctx: click.Context) -> Outbox:
    """The Outbox of ``-A``, loaded once per invocation; bad config exits 2 with the reason."""
    root = ctx.find_root()
    root.ensure_object(dict)
    if "outbox" not in root.obj:
        try:
            outbox = load_outbox(root.obj.get("app_spec") or DEFAULT_APP)
            outbox.check()
        except ConfigError as e:
            raise click.UsageError(f"bad configuration: {e}") from None
        except OutboxError as e:
            raise click.ClickException(str(e)) from None
        root.obj["outbox"] = outbox
    found: Outbox = root.obj["outbox"]
    return found


def get_settings(ctx: click.Context) -> Settings:
    return get_outbox(ctx).settings


def handle_errors(fn: F) -> F:
    """Turn our own errors into a one-line message and exit code 1 (bad input stays exit 2)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            raise click.UsageError(f"bad configuration: {e}") from None
        except OutboxError as e:
            raise click.ClickException(str(e)) from None
        except sa_exc.DBAPIError as e:  # a driver error the core did not wrap: one line, no SQL, no URL
            first = str(e.orig).strip().splitlines()[0] if str(e.orig).strip() else e.orig.__class__.__name__
            hint = " (is the schema migrated? run 'outbox db upgrade')" if "no such table" in first or \
                "does not exist" in first else ""
            raise click.ClickException(f"database error: {e.orig.__class__.__name__}: {first}{hint}") from None

    return wrapper  # type: ignore[return-value]


_DURATION = re.compile(r"^(\d+)(ms|s|m|h|d)$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


class Duration(click.ParamType):  # type: ignore[type-arg]
    """``500ms``, ``30s``, ``15m``, ``2h``, ``7d`` -> milliseconds."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        m = _DURATION.match(str(value).strip())
        if not m:
            self.fail(f"{value!r} is not a duration like 500ms, 30s, 15m, 2h or 7d", param, ctx)
        return int(m.group(1)) * _UNIT_MS[m.group(2)]
