"""MkDocs hook (mkdocs.yml ``hooks:``): the site's home page is the repository's README.md.

The README links into ``docs/`` with paths relative to the repository root (``docs/operations.md``);
on the site those pages sit next to the home page, so the ``docs/`` prefix is dropped. Nothing else
is rewritten, so ``mkdocs build --strict`` still reports every link the README gets wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HOME = "index.md"


def readme_as_home(readme: str) -> str:
    """The README's text with its ``docs/`` links made relative to the site's home page."""
    return readme.replace("](docs/", "](")


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != HOME:
        return markdown
    root = Path(config["config_file_path"]).resolve().parent
    return readme_as_home((root / "README.md").read_text(encoding="utf-8"))
