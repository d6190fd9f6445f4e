"""What ``python -m build`` makes: an sdist and a wheel that ``twine check`` accepts, the wheel holding the one package
``celery_outbox`` with every file of it (package data included), and the wheel never shadowing a user's own
``orders`` or ``consumers`` package."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.package.conftest import ROOT, Dist, pip_env

pytestmark = pytest.mark.slow

# What the reference deployment and the repository's tooling are called: none of it ships.
NOT_SHIPPED = ("orders", "relay", "consumers", "celeryconfig.py", "devtools", "chaos", "bench", "examples", "tests")


def library_files() -> set[str]:
    """Every file of celery_outbox/ in the checkout (the source of the build), bytecode aside."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "celery_outbox").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def test_twine_check_accepts_the_sdist_and_the_wheel(dist: Dist) -> None:
    out = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(dist.sdist), str(dist.wheel)],
                         env=pip_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("PASSED") == 2, out.stdout


def test_the_wheel_holds_only_celery_outbox_and_all_of_it(dist: Dist) -> None:
    names = zipfile.ZipFile(dist.wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"celery_outbox"}
    # every file of the package ships: modules, Alembic's template and versions, the Django migrations, py.typed
    shipped = {n for n in names if n.startswith("celery_outbox/")}
    assert shipped == library_files(), (sorted(library_files() - shipped), sorted(shipped - library_files()))
    assert "celery_outbox/py.typed" in shipped and "celery_outbox/migrations/script.py.mako" in shipped
    assert any(n.startswith("celery_outbox/contrib/django/migrations/0001") for n in shipped)
    assert "celery_outbox/contrib/flask/templates/outbox_admin/list.html" in shipped  # the Flask admin pages
    # the console script and the pytest plugin are declared
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    declared = zipfile.ZipFile(dist.wheel).read(entry_points).decode()
    assert "outbox = celery_outbox.cli:main" in declared and "pytest11" in declared


def test_the_sdist_builds_the_same_library_and_no_deployment(dist: Dist) -> None:
    # python -m build made the wheel FROM this sdist, so the sdist has what the wheel needs
    with tarfile.open(dist.sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md"} <= names
    assert library_files() <= names
    assert not any(n.split("/")[0] in NOT_SHIPPED for n in names), sorted(n for n in names
                                                                           if n.split("/")[0] in NOT_SHIPPED)


def test_users_own_orders_and_consumers_packages_win(dist: Dist, tmp_path: Path) -> None:
    # Given the wheel installed (no dependencies: only its files matter here) into a fresh target,
    # and a project with its own orders/ and consumers/
    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                              str(dist.wheel)], env=pip_env(), capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    top = sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin")
    assert top == ["celery_outbox"]
    project = tmp_path / "project"
    for pkg in ("orders", "consumers"):
        (project / pkg).mkdir(parents=True)
        (project / pkg / "__init__.py").write_text(f"MINE = {pkg!r}\n")
    probe = ("import orders, consumers, celery_outbox, celery_outbox.outbox, celery_outbox.cli;"
             "print(orders.MINE, consumers.MINE, celery_outbox.__file__)")
    # When all three are imported from the project directory (the wheel's files on the path, then this venv's)
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path[:0] = {[str(project), str(target)]!r};"
                          + probe], cwd=project, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         timeout=120)
    # Then the user's packages are the user's, and celery_outbox comes from the wheel
    assert out.returncode == 0, out.stderr[-3000:]
    mine_orders, mine_consumers, path = out.stdout.split()
    assert (mine_orders, mine_consumers) == ("orders", "consumers")
    assert path.startswith(str(target))


def test_the_metadata_claims_the_pythons_and_djangos_of_docs_compatibility(dist: Dist) -> None:
    wheel = zipfile.ZipFile(dist.wheel)
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    lines = wheel.read(metadata).decode().splitlines()
    classifiers = [line.split(": ", 1)[1] for line in lines if line.startswith("Classifier: ")]
    pythons = sorted(c.rsplit(" :: ", 1)[1] for c in classifiers if c.startswith("Programming Language :: Python :: 3."))
    djangos = sorted(c.rsplit(" :: ", 1)[1] for c in classifiers if c.startswith("Framework :: Django :: "))
    assert "Requires-Python: >=3.11" in lines
    assert pythons == ["3.11", "3.12", "3.13"]
    assert djangos == ["5.2", "6.0", "6.1"]
    assert "Requires-Dist: django<7,>=5.2; extra == \"django\"" in lines, [x for x in lines if "django" in x.lower()]
    page = (ROOT / "docs" / "compatibility.md").read_text()
    assert "| Python | 3.11, 3.12, 3.13 |" in page and "| Django (`[django]`) | 5.2 LTS, 6.x |" in page
