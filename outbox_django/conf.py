"""Build Django's ``DATABASES`` entry from the same URL the relay uses (``OUTBOX_DATABASE_URL``)."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from outbox.errors import ConfigError


def database_settings(url: str, **extra: Any) -> dict[str, Any]:
    """``postgresql://user:pw@host:port/name`` or ``sqlite:///path`` -> a Django database dict.

    One URL for Django and the relay means they cannot drift onto two databases (the outbox would
    then never be published).
    """
    parts = urlsplit(url)
    scheme = parts.scheme.split("+", 1)[0]
    if scheme in ("postgresql", "postgres"):
        name = unquote(parts.path.lstrip("/"))
        if not name:
            raise ConfigError(f"database URL {url!r} names no database")
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(parts.port or ""),
            **extra,
        }
    if scheme == "sqlite":
        path = url.split("///", 1)[-1] if "///" in url else ""
        if not path:
            raise ConfigError(f"database URL {url!r} names no SQLite file")
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": path, **extra}
    raise ConfigError(f"database URL must be postgresql:// or sqlite:///, got {url!r}")
