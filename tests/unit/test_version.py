"""``celery_outbox.__version__`` is the installed distribution's version (pyproject.toml's in a bare checkout)."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import celery_outbox
from celery_outbox import version

ROOT = Path(__file__).resolve().parents[2]


def test_the_version_is_the_installed_metadata_version() -> None:
    assert celery_outbox.__version__ == metadata.version("celery-outbox")
    # and the one pyproject.toml declares (the editable install of this checkout)
    assert celery_outbox.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def missing(name: str) -> str:
    raise metadata.PackageNotFoundError(name)


def test_a_checkout_without_metadata_reads_its_pyproject(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Given no installed distribution
    monkeypatch.setattr(metadata, "version", missing)
    # Then the pyproject.toml beside the package says the version
    assert version.package_version() == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "celery-outbox"\nversion = "9.8.7"\n')
    assert version.package_version(pyproject=other) == "9.8.7"
    # And another project's, a broken or a missing one, is not taken for ours
    other.write_text('[project]\nname = "someone-else"\nversion = "1.0"\n')
    assert version.package_version(pyproject=other) == "0+unknown"
    other.write_text("[project\n")
    assert version.package_version(pyproject=other) == "0+unknown"
    assert version.package_version(pyproject=tmp_path / "absent.toml") == "0+unknown"
