"""The package's version: the installed distribution's metadata, else pyproject.toml of a source checkout.

Read once when ``celery_outbox`` is imported (``celery_outbox.__version__``): files only, nothing started,
connected or read from the environment.
"""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "celery-outbox"
UNKNOWN = "0+unknown"


def package_version(*, pyproject: Path | None = None) -> str:
    """The installed ``celery-outbox``'s version; in a checkout that was never installed (the repository on
    ``sys.path``), the ``[project] version`` of the pyproject.toml beside the package; else ``0+unknown``."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pass
    path = pyproject if pyproject is not None else Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        project = tomllib.loads(path.read_text(encoding="utf-8")).get("project", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return UNKNOWN
    found = project.get("version") if project.get("name") == DISTRIBUTION else None
    return found if isinstance(found, str) and found else UNKNOWN
