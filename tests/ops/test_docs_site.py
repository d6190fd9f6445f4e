"""The documentation cannot drift: the site builds with warnings as errors, and the adoption code is the code
the adoption tests run.

- ``mkdocs build --strict`` (mkdocs.yml): every internal link and anchor resolves, every page is in the nav,
  the API reference renders from the docstrings; the site's home page is the README.
- Each file the README's "Adopt it" sections show (a ``# path`` line opens it) is a file of the adoption
  projects that tests/adoption/ runs with real workers: every line the README shows is in that file, in
  order. So an edit to either that the other does not follow fails here, and what the README shows runs.
- The other executed pages: the "Running it for real" block (tests/ops/test_readme_commands.py) and the
  incident drill (tests/ops/test_incident_drill.py) run their pages' commands as written.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import celery_outbox

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = str(Path(sys.executable).parent / "mkdocs")
ADOPTION = {"Adopt it (Flask + SQLAlchemy)": ROOT / "tests" / "adoption" / "flask_shop",
            "Adopt it (Django)": ROOT / "tests" / "adoption" / "django_project"}
_OPENS_A_FILE = re.compile(r"# ([\w/]+\.py)\b")


def build(site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([MKDOCS, "build", "--strict", "--site-dir", str(site)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    r = build(tmp_path / "site")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" not in r.stderr, r.stderr
    home = (tmp_path / "site" / "index.html").read_text()
    # The home page is the README, its docs/ links pointing at the pages next to it
    assert "Adopt it (Flask + SQLAlchemy)" in home and "Two commands" in home
    assert 'href="operations/"' in home and 'href="docs/' not in home
    # The API reference has an entry for every public name (a function named like its own submodule,
    # ``consumer``, is listed as the module, which the page hides) and for the contrib and testing helpers
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    anchors = set(re.findall(r'id="(celery_outbox[^"]*)"', api))
    public = {f"celery_outbox.{n}" for n in celery_outbox.__all__
              if importlib.util.find_spec(f"celery_outbox.{n}") is None}
    assert public - anchors == set(), sorted(public - anchors)
    assert {"celery_outbox.contrib.flask.init_app", "celery_outbox.contrib.django.DjangoOutbox",
            "celery_outbox.testing.run_pending"} <= anchors


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    # Given a copy of the docs with one link to a missing anchor
    copy = tmp_path / "repo"
    copy.mkdir()
    for name in ("mkdocs.yml", "README.md"):
        (copy / name).write_text((ROOT / name).read_text())
    (copy / "devtools").mkdir()
    (copy / "devtools" / "mkdocs_hooks.py").write_text((ROOT / "devtools" / "mkdocs_hooks.py").read_text())
    (copy / "docs").mkdir()
    for page in (ROOT / "docs").glob("*.md"):
        (copy / "docs" / page.name).write_text(page.read_text())
    drill = copy / "docs" / "incident-drill.md"
    drill.write_text(drill.read_text().replace("(operations.md#dashboards-and-alerts)", "(operations.md#no-such-part)"))
    (copy / "celery_outbox").symlink_to(ROOT / "celery_outbox")
    # When it is built in strict mode
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([MKDOCS, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=copy, env=env,
                       capture_output=True, text=True, timeout=300)
    # Then the build fails naming the link
    assert r.returncode != 0
    assert "no-such-part" in r.stderr, r.stderr


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def shown_files(section: str) -> dict[str, list[str]]:
    """path -> the lines the section's python blocks show of it (``# path`` opens a file)."""
    files: dict[str, list[str]] = {}
    for block in re.findall(r"```python\n(.*?)```", section, flags=re.S):
        current: list[str] | None = None
        for line in block.splitlines():
            m = _OPENS_A_FILE.match(line)
            if m:
                current = files.setdefault(m.group(1), [])
                continue
            assert current is not None, f"a line before any '# path' line: {line!r}"
            current.append(line)
    return files


def in_order(shown: list[str], actual: list[str]) -> str | None:
    """None when every non-blank shown line is a line of ``actual``, in order; else the first that is not."""
    rest = iter(line.rstrip() for line in actual)
    for line in (s.rstrip() for s in shown if s.strip()):
        if not any(line == a for a in rest):
            return line
    return None


@pytest.mark.parametrize("title", sorted(ADOPTION))
def test_the_adoption_code_is_the_code_the_adoption_tests_run(title: str) -> None:
    files = shown_files(readme_section(title))
    assert len(files) >= 2, f"{title}: expected the glue's files, found {sorted(files)}"
    for path, shown in files.items():
        actual = ADOPTION[title] / path
        assert actual.is_file(), f"{title} shows {path}, which {ADOPTION[title].relative_to(ROOT)} does not have"
        missing = in_order(shown, actual.read_text().splitlines())
        assert missing is None, f"{title}: {path} as shown has {missing!r}, not in {actual.relative_to(ROOT)} (in order)"


def test_the_check_catches_a_line_the_project_does_not_run() -> None:
    # Given the Flask section with one line changed
    section = readme_section("Adopt it (Flask + SQLAlchemy)").replace("max_retries=3", "max_retries=5")
    shown = shown_files(section)["shop/app.py"]
    actual = (ADOPTION["Adopt it (Flask + SQLAlchemy)"] / "shop" / "app.py").read_text().splitlines()
    # Then the line is named
    missing = in_order(shown, actual)
    assert missing is not None and "max_retries=5" in missing
