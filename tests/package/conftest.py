"""The package as a user gets it: ``python -m build`` once per test session, then fresh virtualenvs that install
the WHEEL (never the checkout, never editable) with one extra at a time, run from an empty temporary directory
so that nothing of the repository is on ``sys.path``.

Each virtualenv is built once per session and shared by the tests that need its extra; pip's cache is the
user's (a warm cache makes an install a matter of seconds, a cold one downloads from the index as a user would).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.services import IN_CI

ROOT = Path(__file__).resolve().parents[2]
# What a copy of the checkout leaves out before building: VCS data, virtualenvs, caches, build output.
IGNORED = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "var", "*.egg-info", "__pycache__",
                                 ".mypy_cache", ".ruff_cache", ".pytest_cache", "node_modules")


@dataclass(frozen=True)
class Dist:
    wheel: Path
    sdist: Path


@dataclass
class Venv:
    """A fresh virtualenv with the wheel installed; ``run`` runs one of its commands in an empty directory."""

    root: Path
    home: Path
    installed: list[str] = field(default_factory=list)

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.root / "bin" / name

    def env(self, **extra: str) -> dict[str, str]:
        """A user's shell: this venv's bin first, a HOME of its own, no PYTHONPATH, no OUTBOX_* of ours."""
        base = {"PATH": f"{self.root / 'bin'}:/usr/bin:/bin", "HOME": str(self.home), "LANG": "C.UTF-8"}
        return {**base, **extra}

    def run(self, argv: list[str], *, cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, cwd=cwd, env=env if env is not None else self.env(), capture_output=True,
                              text=True, timeout=timeout)

    def check(self, argv: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
        out = self.run(argv, cwd=cwd, env=env, timeout=timeout)
        assert out.returncode == 0, f"{argv} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
        return out.stdout


VenvFactory = Callable[..., Venv]


def pip_env() -> dict[str, str]:
    """pip's environment: the user's (its cache and configuration), without the variables of this test run."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("OUTBOX_")}


def interpreter(minor: str) -> str | None:
    """A ``python3.<minor>`` that runs: on PATH, else pyenv's newest of that version (the shim may have none active)."""
    candidates = [f"python{minor}"]
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += [str(p / "bin" / f"python{minor}") for p in sorted(pyenv_root.glob(f"versions/{minor}.*"), reverse=True)]
    for candidate in candidates:
        try:
            out = subprocess.run([candidate, "-c", "import sys; print(sys.executable)"], capture_output=True,
                                 text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0:
            return out.stdout.strip()
    return None


def need(what: str, available: bool) -> None:
    """Skip locally, fail under CI=true, when something the test needs is not on this machine."""
    if not available:
        if IN_CI:
            pytest.fail(f"CI=true and {what} is missing", pytrace=False)
        pytest.skip(f"{what} is missing")


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    """sdist + wheel built by ``python -m build`` from a clean copy of the checkout (a stale build/ or .venv in
    the checkout must not leak into them)."""
    src = tmp_path_factory.mktemp("src") / "celery-outbox"
    shutil.copytree(ROOT, src, ignore=IGNORED)
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(src)], env=pip_env(),
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = out.glob("celery_outbox-*.whl")
    (sdist,) = out.glob("celery_outbox-*.tar.gz")
    return Dist(wheel=wheel, sdist=sdist)


@pytest.fixture(scope="session")
def venv_factory(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VenvFactory]:
    """``venv_factory("flask", "flask-sqlalchemy")``: a virtualenv with ``celery-outbox[flask]`` from the wheel and
    what else the user installs beside it; one per distinct request in the session."""
    made: dict[tuple[str, tuple[str, ...]], Venv] = {}

    def make(extra: str = "", *beside: str) -> Venv:
        key = (extra, beside)
        if key not in made:
            root = tmp_path_factory.mktemp(f"venv-{extra or 'bare'}")
            subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=300)
            requirement = f"{dist.wheel}[{extra}]" if extra else str(dist.wheel)
            install = subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q", requirement, *beside],
                                     env=pip_env(), capture_output=True, text=True, timeout=900)
            assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-5000:]
            home = tmp_path_factory.mktemp(f"home-{extra or 'bare'}")
            made[key] = Venv(root=root, home=home, installed=[requirement, *beside])
        return made[key]

    yield make


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty directory to run from, as a user's new project: nothing of the repository on sys.path."""
    path = tmp_path / "project"
    path.mkdir()
    return path
