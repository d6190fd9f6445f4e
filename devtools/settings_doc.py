"""docs/settings.md's per-setting tables, generated from the settings' declarations.

Each setting is declared once (celery_outbox/settings.py, and celeryconfig.py for this deployment's
own); the tables between the ``<!-- begin: NAME -->`` and ``<!-- end: NAME -->`` markers of
docs/settings.md are written from those declarations, the prose around them by hand.
``python -m devtools settings-doc`` rewrites the tables; ``--check`` only says whether they are
stale (tests/unit/test_settings_doc.py runs the same check).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import click

from celery_outbox import Settings as LibrarySettings
from celery_outbox.config.declare import BROKER_NAMES, Option, variable
from celeryconfig import Settings as DeploymentSettings

PAGE = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
_REGION = re.compile(r"(<!-- begin: (?P<name>[a-z]+) -->\n)(?P<body>.*?)(<!-- end: (?P=name) -->)", re.DOTALL)


def _cell(text: str) -> str:
    if "\n" in text:
        raise ValueError(f"a table cell must be one line, got {text[:60]!r}")
    return text.replace("|", "\\|")


def default_text(value: Any, option: Option) -> str:
    """A default as the table shows it."""
    if isinstance(value, (str, tuple, Mapping)) and not value:
        return "(empty)" if isinstance(value, str) else "(none)"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Path):
        return f"`{value}`"
    return f"`{option.rule.as_env(value)}`"


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def settings_table(cls: type[LibrarySettings], names: list[str] | None = None) -> str:
    """One row per setting of ``cls`` (``names``: only those): variable, default, values, meaning."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    rows = ["| variable | default | values | meaning |", "|---|---|---|---|"]
    for name in names if names is not None else list(fields):
        option = cls.OPTIONS[name]
        values = option.rule.allowed() + (f" ({option.why})" if option.why else "")
        only = " or ".join(BROKER_NAMES.get(b, b) for b in option.brokers)
        meaning = f"{only} only: {option.doc}" if only else option.doc
        rows.append(f"| `{variable(name)}` | {_cell(default_text(_default(fields[name]), option))} | "
                    f"{_cell(values)} | {_cell(meaning)} |")
    return "\n".join(rows) + "\n"


def relations_table(cls: type[LibrarySettings]) -> str:
    rows = ["| rule | why |", "|---|---|"]
    rows += [f"| {_cell(r.doc())} | {_cell(r.why)} |" for r in cls.RELATIONS]
    return "\n".join(rows) + "\n"


def deployment_names() -> list[str]:
    """The settings this deployment adds or gives its own default and doc."""
    return [f.name for f in dataclasses.fields(DeploymentSettings)
            if DeploymentSettings.OPTIONS[f.name] is not LibrarySettings.OPTIONS.get(f.name)]


TABLES: Mapping[str, Callable[[], str]] = {
    "settings": lambda: settings_table(LibrarySettings),
    "deployment": lambda: settings_table(DeploymentSettings, deployment_names()),
    "relations": lambda: relations_table(LibrarySettings),
}


def render(page: str) -> str:
    """``page`` with every marked table written from the declarations (each must be there, once)."""
    found = [m.group("name") for m in _REGION.finditer(page)]
    if sorted(found) != sorted(TABLES):
        raise ValueError(f"docs/settings.md must mark each of {', '.join(TABLES)} once, found {', '.join(found)}")
    return _REGION.sub(lambda m: m.group(1) + TABLES[m.group("name")]() + m.group(4), page)


@click.command("settings-doc")
@click.option("--check", is_flag=True, help="Only say whether docs/settings.md is stale (exit 1 if it is).")
def settings_doc(check: bool) -> None:
    """Write docs/settings.md's per-setting tables from the settings' declarations."""
    page = PAGE.read_text(encoding="utf-8")
    fresh = render(page)
    if check:
        if fresh != page:
            raise click.ClickException("docs/settings.md is stale: run `python -m devtools settings-doc`")
        click.echo("docs/settings.md is up to date")
        return
    PAGE.write_text(fresh, encoding="utf-8")
    click.echo("docs/settings.md " + ("unchanged" if fresh == page else "written"))
