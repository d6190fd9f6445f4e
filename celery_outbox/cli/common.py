"""Shared CLI plumbing: settings from the environment, errors as clear messages and exit codes."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.text import Text
from sqlalchemy import exc as sa_exc

from celery_outbox.cli.app import resolve
from celery_outbox.config.masking import mask_secrets
from celery_outbox.errors import ConfigError, DatabaseError, OutboxError, ValidationError
from celery_outbox.outbox import Outbox
from celery_outbox.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])


class BadInput(click.ClickException):
    """A bad value or a bad configuration: one ``Error: ...`` line and exit 2, without click's usage
    lines (they would point at the command line when the problem is an ``OUTBOX_*`` variable)."""

    exit_code = 2


class OutboxGroup(click.Group):
    """The root group: every command under it, present and future, runs inside ``cli_errors()``, so no
    error reaches the user as a traceback or with a password in it, and a bad option value is one line."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            raise _shown_safely(e) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with cli_errors():
                return super().invoke(ctx)
        except click.BadParameter as e:
            raise BadInput(one_line(e.format_message())) from None
        except click.UsageError as e:  # an unknown command or option, an extra argument: click repeats it
            raise _shown_safely(e) from None


def _shown_safely(error: click.UsageError) -> click.UsageError:
    """``error`` as one line (docs/operations.md, "Probes and exit codes"): what it repeats of the command line
    masked (a URL password) and made printable, and where to read the usage named in the same line instead of
    click's usage lines above it. A group run without a command keeps click's answer: its help."""
    if isinstance(error, click.exceptions.NoArgsIsHelpError):
        return error
    hint = f" (see '{error.ctx.command_path} -h')" if error.ctx is not None else ""
    return click.UsageError(one_line(error.format_message()) + printable(hint), ctx=None)


def settings_group(fn: Callable[..., None]) -> click.Group:
    @click.group(cls=OutboxGroup, context_settings={"help_option_names": ["-h", "--help"]})
    @click.option("-A", "--app", "app_spec", default=None, metavar="MODULE[:ATTR]",
                  help="Where your Outbox lives, like celery -A. Without it: $OUTBOX_APP, then [tool.celery-outbox] "
                       "app in the nearest pyproject.toml, then DJANGO_SETTINGS_MODULE's DjangoOutbox, then "
                       "FLASK_APP's FlaskOutbox.")
    @click.version_option(package_name="celery-outbox", prog_name="outbox")
    @click.pass_context
    @functools.wraps(fn)
    def group(ctx: click.Context, app_spec: str | None) -> None:
        ctx.ensure_object(dict)
        ctx.obj["app_spec"] = app_spec

    return group


def get_outbox(ctx: click.Context) -> Outbox:
    """The user's Outbox (``-A``, ``OUTBOX_APP``, pyproject.toml, Django, Flask: celery_outbox/cli/app.py), loaded
    once per invocation; bad config exits 2 with the reason. A group that already holds one (``flask outbox``:
    the app's) hands it down in its ``obj``."""
    given = ctx.obj.get("outbox") if isinstance(ctx.obj, dict) else None
    if isinstance(given, Outbox):
        return given
    root = ctx.find_root()
    root.ensure_object(dict)
    if "outbox" not in root.obj:
        try:
            # What the user's project prints while it loads (a banner, a logging handler bound to stdout then) goes to
            # stderr: with --json, stdout is one JSON document (docs/operations.md, "Probes and exit codes").
            with contextlib.redirect_stdout(sys.stderr):
                outbox, flask_app = resolve(root.obj.get("app_spec"))
            if flask_app is not None:  # FLASK_APP: the command runs inside the app, as `flask outbox` does
                root.with_resource(flask_app.app_context())
            outbox.check()
        except ConfigError as e:
            raise BadInput(f"bad configuration: {one_line(str(e))}") from None
        except OutboxError as e:
            raise click.ClickException(one_line(str(e))) from None
        root.obj["outbox"] = outbox
    found: Outbox = root.obj["outbox"]
    return found


def get_settings(ctx: click.Context) -> Settings:
    return get_outbox(ctx).settings


_MISSING_TABLE = re.compile(r'no such table|relation "[^"]*" does not exist|undefinedtable', re.IGNORECASE)
DB_UPGRADE = "outbox db upgrade"


def upgrade_hint() -> str:
    """What to do about missing outbox tables: run the command that makes them for the outbox this invocation
    loaded (``Outbox.schema_command``: ``python manage.py migrate`` in a Django project with the app installed),
    ``outbox db upgrade`` before one is loaded."""
    command = DB_UPGRADE
    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        found = ctx.obj.get("outbox") if isinstance(ctx.obj, dict) else None
        if isinstance(found, Outbox):
            try:
                command = found.schema_command
            except Exception:  # a hint must never hide the error it explains
                command = DB_UPGRADE
            break
        ctx = ctx.parent
    return f"the outbox tables are missing: run `{command}`"
TRACEBACK_ENV = "OUTBOX_TRACEBACK"


def traceback_wanted(environ: Mapping[str, str]) -> bool:
    """``OUTBOX_TRACEBACK`` is on: 1, true, yes or on (``0`` or ``false`` turned it on, as any text did)."""
    return environ.get(TRACEBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def one_line(text: str, *, limit: int = 1000) -> str:
    """The first non-empty line of ``text``, masked, its control characters escaped (``printable``) and cut to
    ``limit`` characters."""
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    first = printable(first)
    return first if len(first) <= limit else first[: limit - 3] + "..."


# Characters that act on a terminal instead of showing: C0 and C1 controls but tab and newline (ESC starts the
# sequences that recolour, retitle or clear it), bidi overrides (they reorder what is shown) and lone surrogates
# (not encodable: printing one fails).
_TERMINAL_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` with every character that would act on a terminal shown as its escape (``\\x1b``, ``\\u202e``), and
    every URL password masked.

    What the commands print comes from the database, and much of it from whoever produced a message
    (error texts, types, consumer names, payloads): it is shown, never obeyed, and an error text that quotes a
    URL with its credentials (an HTTP client's) shows none of them."""
    return _TERMINAL_CONTROL.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii"),
                                 mask_secrets(text))


class SafeConsole(Console):
    """The rich console of every human output: stored text is shown as written. No markup (a ``[/bold]`` in
    an error text is text, not a tag that breaks the listing), no emoji codes, no highlighting, and control
    characters escaped (``printable``), URL passwords masked (a stored error text may quote one). The commands' own
    styling is passed as ``rich.text.Text``."""

    def __init__(self, **options: Any) -> None:
        super().__init__(markup=False, emoji=False, highlight=False, **options)

    def render_str(self, text: str, **options: Any) -> Text:
        options.update(markup=False, emoji=False, highlight=False)
        return super().render_str(printable(text), **options)


def database_message(orig: BaseException) -> str:
    """One line for a driver error: what happened and what to do, never SQL, parameters or a password."""
    name = orig.__class__.__name__
    first = one_line(str(orig)) or name
    lowered = f"{name} {first}".lower()
    if _MISSING_TABLE.search(lowered):
        return f"database error: {first} ({upgrade_hint()})"
    return f"database error: {name}: {first}"


@contextmanager
def cli_errors() -> Iterator[None]:
    """Our errors, driver errors and anything unexpected as one line on stderr and exit 1 (bad
    configuration exit 2); click's own exceptions pass through. ``OUTBOX_TRACEBACK=1`` re-raises."""
    try:
        yield
    except (click.ClickException, click.exceptions.Exit, click.Abort):
        raise
    except BrokenPipeError:  # the reader of stdout went away (`| head -1`): click exits 1 quietly, as for any command
        raise
    except ConfigError as e:
        raise BadInput(f"bad configuration: {one_line(str(e))}") from None
    except DatabaseError as e:  # the core's wrapped driver error: its message, plus what to do
        cause = e.__cause__
        hint = ""
        if isinstance(cause, sa_exc.DBAPIError) and _MISSING_TABLE.search(f"{type(cause.orig).__name__} {cause.orig}"):
            hint = f" ({upgrade_hint()})"
        raise click.ClickException(f"{one_line(str(e)) or 'database error'}{hint}") from None
    except OutboxError as e:
        raise click.ClickException(one_line(str(e)) or e.__class__.__name__) from None
    except sa_exc.DBAPIError as e:  # a driver error the core did not wrap: one line, no SQL, no URL
        raise click.ClickException(database_message(e.orig if e.orig is not None else e)) from None
    except sa_exc.SQLAlchemyError as e:  # a bad URL, a missing driver: SQLAlchemy's text can carry the URL
        raise click.ClickException(f"database error: {e.__class__.__name__}: {one_line(str(e))}") from None
    except Exception as e:
        if traceback_wanted(os.environ):  # the traceback asked for, masked like every other output
            click.echo(printable("".join(traceback.format_exception(e))), err=True, nl=False)
            raise click.exceptions.Exit(1) from None
        raise click.ClickException(
            f"unexpected {e.__class__.__name__}: {one_line(str(e))} (set {TRACEBACK_ENV}=1 for the traceback)"
        ) from None


def handle_errors(fn: F) -> F:
    """Turn errors into a one-line message and exit code 1 (bad input stays exit 2)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with cli_errors():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


# Numbers on the command line are ASCII digits only: ``int()``, ``float()`` and ``str.isdigit`` also take
# other scripts' digits ("\u0661" is read as 1), and a look-alike must never stand for a number.
_DURATION = re.compile(r"([0-9]{1,15})(ms|s|m|h|d)", re.ASCII)
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
MAX_DURATION_MS = 100 * 365 * 86_400_000  # a century: past it a duration is a typo, and it stays within 64 bits
_INT_TEXT = re.compile(r"[0-9]{1,18}", re.ASCII)
_FLOAT_TEXT = re.compile(r"[0-9]{1,12}(?:\.[0-9]{0,12})?|\.[0-9]{1,12}", re.ASCII)


def shown(value: Any) -> str:
    """A value the user gave, as an error repeats it: quoted, cut at 40 characters."""
    text = repr(str(value))
    return text if len(text) <= 40 else text[:40] + "..."


class Duration(click.ParamType):  # type: ignore[type-arg]
    """``500ms``, ``30s``, ``15m``, ``2h``, ``7d`` (ASCII digits) -> milliseconds."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        m = _DURATION.fullmatch(str(value).strip(" \t\r\n"))
        if not m:
            self.fail(f"{shown(value)} is not a duration like 500ms, 30s, 15m, 2h or 7d (ASCII digits)", param, ctx)
        ms = int(m.group(1)) * _UNIT_MS[m.group(2)]
        if ms > MAX_DURATION_MS:
            self.fail(f"{shown(value)} is longer than a century", param, ctx)
        return ms


class AsciiInt(click.ParamType):  # type: ignore[type-arg]
    """A whole number written in ASCII digits, at least ``low`` and at most ``high`` when given (``click.IntRange``
    reads any script's digits)."""

    name = "integer"

    def __init__(self, *, low: int = 1, high: int | None = None) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif _INT_TEXT.fullmatch(str(value).strip(" \t\r\n")):
            number = int(str(value).strip(" \t\r\n"))
        else:
            self.fail(f"{shown(value)} is not a whole number in ASCII digits", param, ctx)
        if number < self.low:
            self.fail(f"{number} is below {self.low}", param, ctx)
        if self.high is not None and number > self.high:
            self.fail(f"{number} is above {self.high}", param, ctx)
        return number


class AsciiSeconds(click.ParamType):  # type: ignore[type-arg]
    """A finite number of seconds in ASCII digits (``1``, ``0.25``), at least ``low``; never nan or inf."""

    name = "seconds"

    def __init__(self, *, low: float) -> None:
        self.low = low

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif _FLOAT_TEXT.fullmatch(str(value).strip(" \t\r\n")):
            number = float(str(value).strip(" \t\r\n"))
        else:
            self.fail(f"{shown(value)} is not a number of seconds in ASCII digits, like 1 or 0.25", param, ctx)
        if not number >= self.low:  # also refuses nan given in code
            self.fail(f"{number:g} is below {self.low:g}", param, ctx)
        return number


class Checked(click.ParamType):  # type: ignore[type-arg]
    """An argument judged by its form alone, by the library's own check (a dead-letter id, a group id, a trace
    key): one refused is a usage error at parse, exit 2, before the app or the database is reached (one that is
    well formed and names nothing there is exit 1, "not found"). ``check`` returns the value to use."""

    def __init__(self, *, name: str, check: Callable[[str], object]) -> None:
        self.name, self._check = name, check

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            return str(self._check(value))
        except ValidationError as e:
            self.fail(str(e), param, ctx)


def echo_json(data: Any) -> None:
    """The one JSON document a ``--json`` command prints: strict JSON (no NaN or Infinity, which other parsers
    refuse: a non-finite number read from a database is shown as its name, a string), keys sorted, any other
    value as its text, URL passwords in its strings masked (a stored error text may quote one)."""
    click.echo(json.dumps(_finite(data), indent=2, sort_keys=True, default=str, allow_nan=False))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # 'nan', 'inf', '-inf'
    if isinstance(value, str):
        return mask_secrets(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
