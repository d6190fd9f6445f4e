"""The failure matrix (docs/failure-matrix.md) as a table: per row what a run provoked, how often, what it saw."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from chaos.invariants import Violation


@dataclass(frozen=True, kw_only=True)
class MatrixRow:
    failure: str
    provoked: str
    times: int
    observed: str
    ok: bool


def violated(violations: Sequence[Violation], *needles: str) -> list[Violation]:
    """Violations whose invariant name contains any of ``needles``."""
    return [v for v in violations if any(n in v.invariant for n in needles)]


def verdict(rows_ok: bool, text: str, problems: Sequence[Violation]) -> tuple[str, bool]:
    if problems:
        return "VIOLATED: " + "; ".join(f"{p.invariant}: {p.detail}" for p in problems), False
    return text, rows_ok


def render(rows: Sequence[MatrixRow], *, title: str) -> object:
    """A rich Table (imported lazily: only the CLI needs rich)."""
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    table.add_column("failure", style="bold")
    table.add_column("provoked")
    table.add_column("times", justify="right")
    table.add_column("observed outcome")
    table.add_column("", justify="center")
    for row in rows:
        table.add_row(row.failure, row.provoked, str(row.times), row.observed,
                      "[green]ok[/green]" if row.ok else "[red]FAIL[/red]")
    return table
