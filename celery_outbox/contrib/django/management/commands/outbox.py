"""``manage.py outbox ...``: the library's ``outbox`` command (celery_outbox/cli/) on this project's ``DjangoOutbox``.

    python manage.py outbox relay                     # the standalone relay (--once: drain and exit)
    python manage.py outbox dead-letters list         # show ID / replay ID... / purge ID...
    python manage.py outbox stats --json
    python manage.py outbox check                     # readiness: database, schema, broker
    python manage.py outbox prune --older-than 7d

A thin wrapper: the same click commands, options, output and exit codes as ``outbox -A proj.celery ...``,
bound to the ``Outbox`` ``DjangoOutbox(app)`` registered (or ``OUTBOX_INSTANCE``), so no ``-A`` is needed;
``-A MODULE[:ATTR]`` still picks another one. Django's system checks run first (``--skip-checks`` skips them).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_outbox.contrib.django.outbox import project_outbox

PROG = "manage.py outbox"  # also in project_outbox()'s message
_DJANGO_VALUE_OPTIONS = ("--settings", "--pythonpath")  # applied by manage.py before the command runs
_APP_OPTIONS = ("-A", "--app")


def _django_options_removed(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without the options manage.py already applied, and whether ``--skip-checks`` was given."""
    out: list[str] = []
    skip_checks = False
    it = iter(argv)
    for arg in it:
        if arg in _DJANGO_VALUE_OPTIONS:
            next(it, None)
        elif arg.startswith(tuple(f"{o}=" for o in _DJANGO_VALUE_OPTIONS)):
            continue
        elif arg == "--skip-checks":
            skip_checks = True
        else:
            out.append(arg)
    return out, skip_checks


def _names_an_app(argv: list[str]) -> bool:
    """True when the group's own ``-A`` is given (before the first command name)."""
    for arg in argv:
        if arg in _APP_OPTIONS or arg.startswith(("-A", "--app=")):
            return True
        if not arg.startswith("-"):
            return False
    return False


class ProjectOutbox(dict[str, Any]):
    """The click context's ``obj``: its ``"outbox"`` is the project's, found (and checked, as ``outbox -A`` checks
    it) the first time a command asks, so ``--help`` and a mistyped command name need none. A ``ConfigError``
    raised here reaches the user as the ``outbox`` command's one ``Error: bad configuration`` line."""

    def _resolve(self) -> None:
        if not dict.__contains__(self, "outbox"):
            outbox = project_outbox()
            outbox.check()
            self["outbox"] = outbox

    def __contains__(self, key: object) -> bool:
        if key == "outbox":
            self._resolve()
        return dict.__contains__(self, key)

    def __getitem__(self, key: str) -> Any:
        if key == "outbox":
            self._resolve()
        return dict.__getitem__(self, key)


def run_cli(argv: list[str]) -> int:
    """Run the ``outbox`` click command with ``argv``; its exit code. Help, usage errors and one-line errors
    are click's own, exactly as ``outbox`` prints them."""
    from celery_outbox.cli import cli

    obj: dict[str, Any] = {} if _names_an_app(argv) else ProjectOutbox()
    try:
        cli.main(args=argv, prog_name=PROG, obj=obj, standalone_mode=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


class Command(BaseCommand):  # type: ignore[misc]
    help = ("The outbox command on this project's DjangoOutbox: relay, dead-letters (list/show/replay/purge), "
            "stats, check, prune, db. `manage.py outbox --help` lists them.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("outbox_args", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS]...",
                            help="an outbox command and its options (see `manage.py outbox --help`)")

    def run_from_argv(self, argv: list[str]) -> None:
        """From the command line, every argument after ``outbox`` is the click command's (``--help`` too)."""
        args, skip_checks = _django_options_removed(argv[2:])
        try:
            if not skip_checks and not {"-h", "--help", "--version"} & set(args):
                self.check()
        except CommandError as e:
            self.stderr.write(f"{e.__class__.__name__}: {e}")
            sys.exit(e.returncode)
        code = run_cli(args)
        if code:
            sys.exit(code)

    def handle(self, *args: Any, **options: Any) -> None:
        """``call_command("outbox", "stats", "--json")``: output to the command's stdout/stderr, a failure as
        ``CommandError`` with the exit code the ``outbox`` command would have."""
        argv = [str(a) for a in options.get("outbox_args") or args]
        out = getattr(self.stdout, "_out", self.stdout)  # the stream behind Django's OutputWrapper
        err = getattr(self.stderr, "_out", self.stderr)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run_cli(argv)
        if code:
            raise CommandError(f"outbox {' '.join(argv[:2])} exited with {code}", returncode=code)
