"""The README's quick-start code, split into the files it names, as a user copies it into a new project."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
FILE_MARK = re.compile(r"^# (?P<path>[\w/]+\.py)\b.*$")


def python_block(section: str) -> str:
    """The first ```python block under the README heading ``## <section>``."""
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start:end if end != -1 else None]
    match = re.search(r"```python\n(.*?)```", body, re.S)
    assert match, f"README.md: no python block under '## {section}'"
    return match.group(1)


def files(section: str) -> dict[str, str]:
    """The block split at its ``# path/to/file.py`` lines: {path: code} (the marking line kept, as a comment)."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in python_block(section).splitlines():
        mark = FILE_MARK.match(line)
        if mark:
            current = out.setdefault(mark.group("path"), [])
        assert current is not None, f"README.md '## {section}': code before the first '# file.py' line"
        current.append(line)
    return {path: "\n".join(lines).rstrip() + "\n" for path, lines in out.items()}


def write(root: Path, path: str, code: str) -> Path:
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(code)
    return target
