"""A library module over ``MAX_LINES`` lines says in its docstring why it is one piece ("One module,
though long: ..."), so a file that grows past the size a reader takes in at once is split or explained,
never left to grow by default."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "celery_outbox"
MAX_LINES = 450
WHY_ONE_PIECE = "One module, though long:"


def long_modules_without_a_reason(root: Path) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().count("\n")
        if lines <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if WHY_ONE_PIECE not in " ".join(doc.split()):
            bad.append(f"{path.relative_to(root.parent)}: {lines} lines, no '{WHY_ONE_PIECE} ...' in its docstring")
    return bad


def test_every_long_library_module_says_why_it_is_one_piece() -> None:
    assert long_modules_without_a_reason(LIBRARY) == []


def test_a_long_module_without_a_reason_is_named(tmp_path: Path) -> None:
    # Given a package with one long module that explains itself and one that does not
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "x = 1\n" * MAX_LINES
    (pkg / "explained.py").write_text(f'"""Parts.\n\n{WHY_ONE_PIECE} they share state."""\n{body}')
    (pkg / "silent.py").write_text(f'"""Parts."""\n{body}')
    # Then only the silent one is named
    (line,) = long_modules_without_a_reason(pkg)
    assert line.startswith("pkg/silent.py:")
