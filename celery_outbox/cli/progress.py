"""Progress for long commands (``outbox prune``, ``outbox dead-letters replay``): the core calls back per
batch or item, this module renders it.

- on a terminal: rich progress bars (lines about single items print above them);
- otherwise (a pipe, a file, cron): one plain line per step, so a log shows how far it got;
- with ``--json``: stdout stays one JSON document; a bar goes to stderr if that is a terminal, else nothing.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import IO

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from celery_outbox.cli.common import SafeConsole, printable


def is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except ValueError:  # a closed stream
        return False


class ProgressView:
    """Bars on a terminal, plain lines elsewhere, silence for a machine reading a non-terminal."""

    def __init__(self, *, machine: bool = False, stream: IO[str] | None = None, live: bool | None = None) -> None:
        self.stream: IO[str] = stream if stream is not None else (sys.stderr if machine else sys.stdout)
        self.live = is_terminal(self.stream) if live is None else live
        self.quiet = machine and not self.live
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        if self.live:
            console = SafeConsole(file=self.stream, force_terminal=True)
            self._progress = Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=console)

    def __enter__(self) -> ProgressView:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()

    def line(self, text: str) -> None:
        """A line about one step: above the bars on a terminal, as it is elsewhere (never rich markup)."""
        if self._progress is not None:
            self._progress.console.print(text, soft_wrap=True)  # a SafeConsole: shown, never obeyed
        elif not self.quiet:
            click.echo(printable(text), file=self.stream)

    def start(self, key: str, description: str, total: int, *, line: str | None = None) -> None:
        """A bar named ``key`` (plain mode: ``line``, if given, says what starts)."""
        if self._progress is not None:
            self._tasks[key] = self._progress.add_task(description, total=total)
        elif line is not None:
            self.line(line)

    def update(self, key: str, completed: int, total: int, *, line: str | None = None, keep: bool = False) -> None:
        """Move bar ``key`` to ``completed`` of ``total``. ``line`` is printed in plain mode, and above the
        bar too when ``keep`` (a result per item the person wants to read back, not just a count)."""
        if self._progress is not None:
            if key not in self._tasks:
                self._tasks[key] = self._progress.add_task(key, total=total)
            self._progress.update(self._tasks[key], completed=completed, total=total)
            if line is not None and keep:
                self.line(line)
        elif line is not None:
            self.line(line)

    def summary(self, text: str) -> None:
        """The end result, on the command's own output (stdout), after the bars are gone."""
        click.echo(printable(text))
