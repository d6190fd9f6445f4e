"""Shared CLI plumbing: settings from the environment, errors as clear messages and exit codes."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

import click

from celeryconfig import Settings
from outbox.errors import ConfigError, OutboxError

F = TypeVar("F", bound=Callable[..., Any])


def settings_group(fn: Callable[..., None]) -> click.Group:
    @click.group(context_settings={"help_option_names": ["-h", "--help"]})
    @click.pass_context
    @functools.wraps(fn)
    def group(ctx: click.Context) -> None:
        ctx.ensure_object(dict)

    return group


def get_settings(ctx: click.Context) -> Settings:
    """Settings from the environment, built once per invocation; bad config exits 2 with the reason."""
    root = ctx.find_root()
    root.ensure_object(dict)
    if "settings" not in root.obj:
        try:
            root.obj["settings"] = Settings.from_env()
        except ConfigError as e:
            raise click.UsageError(f"bad configuration: {e}") from None
    settings: Settings = root.obj["settings"]
    return settings


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
