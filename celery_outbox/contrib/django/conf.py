"""Django's settings and databases for the outbox.

* ``outbox_settings()``: the library's ``Settings`` from ``settings.py`` (``OUTBOX = {...}`` or ``OUTBOX_*``
  names), over the ``OUTBOX_*`` environment, over the defaults;
* ``database_settings(url)`` (URL -> ``DATABASES`` entry) and ``database_url(alias)`` (``DATABASES`` entry ->
  SQLAlchemy URL); ``connection_url(alias)`` is the URL of the database Django's connection ``alias`` uses
  now (the test database while Django's test runner has one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from celery_outbox.config.masking import bounded_repr, mask_url
from celery_outbox.errors import ConfigError
from celery_outbox.settings import Settings

NOT_SETTINGS = frozenset({"OUTBOX_INSTANCE"})
"""``OUTBOX_*`` Django settings that are not fields of ``Settings`` (read by the admin)."""


def _django_values(django_settings: Any) -> dict[str, Any]:
    """Field -> value from ``OUTBOX = {...}`` (keys as ``relay_batch_size`` or ``RELAY_BATCH_SIZE``) and
    ``OUTBOX_<FIELD>`` names; the same field given both ways is refused (which one would win is a guess)."""
    fields = {f.name for f in dataclasses.fields(Settings)}
    values: dict[str, Any] = {}
    block = getattr(django_settings, "OUTBOX", None)
    if block is not None:
        if not isinstance(block, Mapping):
            raise ConfigError(f"settings.OUTBOX must be a dict of outbox settings, got {type(block).__name__}")
        for key, value in block.items():
            name = str(key).lower()
            if not isinstance(key, str) or name not in fields:
                raise ConfigError(f"settings.OUTBOX has an unknown key {bounded_repr(str(key))} "
                                  f"(known: {', '.join(sorted(fields))})")
            values[name] = value
    for attr in sorted(set(dir(django_settings))):  # set: an override_settings dir() lists a name twice
        if not attr.startswith("OUTBOX_") or attr in NOT_SETTINGS:
            continue
        name = attr[len("OUTBOX_"):].lower()
        if name not in fields:
            continue  # reported by the system check (celery_outbox.E002), never silently used
        if name in values:
            raise ConfigError(f"settings.{attr} and settings.OUTBOX[{name!r}] both set {name}: keep one")
        values[name] = getattr(django_settings, attr)
    return values


def known_setting_names() -> list[str]:
    """The fields of ``Settings``: ``OUTBOX = {name: ...}`` keys, ``OUTBOX_<NAME>`` in settings.py."""
    return sorted(f.name for f in dataclasses.fields(Settings))


def unknown_setting_names(django_settings: Any) -> list[str]:
    """``OUTBOX_*`` names in settings.py that no outbox setting has (a typo is otherwise silently ignored)."""
    fields = set(known_setting_names())
    return sorted(a for a in set(dir(django_settings)) if a.startswith("OUTBOX_") and a not in NOT_SETTINGS
                  and a[len("OUTBOX_"):].lower() not in fields)


def outbox_settings(*, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """The outbox ``Settings`` of this Django project: ``overrides`` > ``settings.py`` > ``OUTBOX_*`` environment
    > defaults. A text value in settings.py (``os.environ["..."]``) is read as the environment variable would be."""
    from django.conf import settings as django_settings

    from celery_outbox.config.rules import Invalid, clause

    rules = Settings.RULES
    values: dict[str, Any] = {}
    errors: list[str] = []
    for name, value in _django_values(django_settings).items():
        if isinstance(value, str):
            try:
                value = rules[name].parse(value)
            except Invalid as e:
                errors.append(clause(f"OUTBOX_{name.upper()}", str(e), value, rules[name]))
                continue
        values[name] = value
    if errors:
        raise ConfigError("; ".join(errors))
    return Settings.from_env(environ, **{**values, **overrides})


def outbox_alias() -> str:
    """The database of the outbox's rows when a call names none (``publish``, ``cancel``, the testing helpers):
    the ``using`` of the project's ``DjangoOutbox`` registered in this process, else the router's choice for
    the outbox models (``DATABASE_ROUTERS``), which is "default" without routers. One rule, so a
    multi-database project that built ``DjangoOutbox(app, using="orders")`` never writes an event to another."""
    from django.db import router

    from celery_outbox.contrib.django import dead_letters
    from celery_outbox.contrib.django.models import OutboxMessage

    alias = getattr(dead_letters.registered(), "using", None)
    return alias if isinstance(alias, str) else str(router.db_for_write(OutboxMessage))


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
    from django.conf import settings

    try:
        entry: dict[str, Any] = settings.DATABASES[alias]
    except KeyError:
        raise ConfigError(f"Django has no database {alias!r} in DATABASES") from None
    return url_of(entry, alias)


def connection_url(alias: str = "default") -> str:
    """The SQLAlchemy URL of the database Django's connection ``alias`` uses now: while Django's test runner
    (or pytest-django) has created the test database, that one, never the developer's."""
    from django.db import connections
    from django.utils.connection import ConnectionDoesNotExist

    try:
        entry: dict[str, Any] = connections[alias].settings_dict
    except ConnectionDoesNotExist:
        raise ConfigError(f"Django has no database {alias!r} in DATABASES") from None
    return url_of(entry, alias)


def url_of(entry: Mapping[str, Any], alias: str) -> str:
    """A Django database entry -> its SQLAlchemy URL (PostgreSQL or a SQLite file)."""
    import sqlalchemy as sa

    engine = str(entry.get("ENGINE", ""))
    if engine.endswith("postgresql"):
        port = str(entry.get("PORT") or "").strip()
        # ASCII digits only: int() would read an Arabic-Indic digit as 1 and raise a traceback on "abc"
        if port and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65_535):
            raise ConfigError(f"Django database {alias!r} has PORT {port[:20]!r}: a port is 1-65535 in ASCII digits")
        url = sa.engine.URL.create(
            "postgresql", username=entry.get("USER") or None, password=entry.get("PASSWORD") or None,
            host=entry.get("HOST") or None, port=int(port) if port else None, database=entry.get("NAME") or None,
        )
        return url.render_as_string(hide_password=False)
    if engine.endswith("sqlite3"):
        name = str(entry.get("NAME") or "")
        if not name or name == ":memory:" or "mode=memory" in name:
            raise ConfigError(f"Django database {alias!r} is an in-memory SQLite; the relay cannot share it (tests: "
                              f"set DATABASES[{alias!r}]['TEST']['NAME'] to a file)")
        return f"sqlite:///{name}"
    raise ConfigError(f"Django database {alias!r} uses {engine!r}; only PostgreSQL and SQLite are supported")
