"""One database for Django and the outbox: ``database_settings(url)`` (URL -> ``DATABASES`` entry) and
``database_url(alias)`` (``DATABASES`` entry -> SQLAlchemy URL)."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from celery_outbox.errors import ConfigError
from celery_outbox.settings import mask_url


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
            raise ConfigError(f"database URL {mask_url(url)!r} names no database")
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
            raise ConfigError(f"database URL {mask_url(url)!r} names no SQLite file")
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": path, **extra}
    raise ConfigError(f"database URL must be postgresql:// or sqlite:///, got {mask_url(url)!r}")


def database_url(alias: str = "default") -> str:
    """Django's ``DATABASES[alias]`` -> the SQLAlchemy URL of the same database (for ``Settings(database_url=...)``).

    The inverse of ``database_settings``: give the ``Outbox`` the database Django writes, so the relay
    and the consumers' bookkeeping see the rows Django commits.
    """
    import sqlalchemy as sa
    from django.conf import settings

    try:
        entry: dict[str, Any] = settings.DATABASES[alias]
    except KeyError:
        raise ConfigError(f"Django has no database {alias!r} in DATABASES") from None
    engine = str(entry.get("ENGINE", ""))
    if engine.endswith("postgresql"):
        port = str(entry.get("PORT") or "")
        url = sa.engine.URL.create(
            "postgresql", username=entry.get("USER") or None, password=entry.get("PASSWORD") or None,
            host=entry.get("HOST") or None, port=int(port) if port else None, database=entry.get("NAME") or None,
        )
        return url.render_as_string(hide_password=False)
    if engine.endswith("sqlite3"):
        name = str(entry.get("NAME") or "")
        if not name or name == ":memory:":
            raise ConfigError(f"Django database {alias!r} is an in-memory SQLite; the relay cannot share it")
        return f"sqlite:///{name}"
    raise ConfigError(f"Django database {alias!r} uses {engine!r}; only PostgreSQL and SQLite are supported")
