"""The wheel installs one package, ``celery_outbox``, and never shadows the user's own packages.

Builds the wheel, installs it (without dependencies: they come from this venv) into a fresh target,
then imports it from a directory that holds the user's own ``orders`` and ``consumers`` packages.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Build from a copy: a stale build/ directory in the checkout must not leak old packages into the wheel.
    src = tmp_path_factory.mktemp("src") / "project"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "var", "*.egg-info",
                                                             "__pycache__", ".mypy_cache", ".ruff_cache"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (found,) = out.glob("celery_outbox-*.whl")
    return found


def test_the_wheel_holds_only_celery_outbox(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"celery_outbox"}
    # the library's migrations and the Django migrations ship with it
    assert any(n.startswith("celery_outbox/migrations/versions/") for n in names)
    assert "celery_outbox/py.typed" in names
    # and the Flask admin pages' templates
    assert "celery_outbox/contrib/flask/templates/outbox_admin/list.html" in names


def test_users_own_orders_and_consumers_packages_win(wheel: Path, tmp_path: Path) -> None:
    # Given the wheel installed into a fresh target and a project with its own orders/ and consumers/
    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    top = sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin")
    assert top == ["celery_outbox"]
    project = tmp_path / "project"
    for pkg in ("orders", "consumers"):
        (project / pkg).mkdir(parents=True)
        (project / pkg / "__init__.py").write_text(f"MINE = {pkg!r}\n")
    probe = ("import orders, consumers, celery_outbox, celery_outbox.outbox, celery_outbox.cli;"
             "print(orders.MINE, consumers.MINE, celery_outbox.__file__)")
    # When all three are imported from the project directory (site-packages of the wheel first on the path)
    env = {"PYTHONPATH": f"{project}:{target}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path[:0] = {[str(project), str(target)]!r};"
                          + probe], cwd=project, env=env, capture_output=True, text=True, timeout=120)
    # Then the user's packages are the user's, and celery_outbox comes from the wheel
    assert out.returncode == 0, out.stderr[-3000:]
    mine_orders, mine_consumers, path = out.stdout.split()
    assert (mine_orders, mine_consumers) == ("orders", "consumers")
    assert path.startswith(str(target))
