"""Readiness: can this process do its work right now? Database reachable, schema at the library's head
revision, broker reachable.

One function answers for every probe (``outbox check``, the web app's ``/readyz``), so the CLI and the
endpoint can never disagree about what "ready" means. The broker is probed through a callable the
caller passes (``celery_outbox.celery.probe`` builds one with kombu), which keeps this module free of
Celery and kombu.

Each check carries two texts: ``reason``, from a fixed vocabulary (``unreachable``, ``not migrated``,
...), which is all an HTTP answer may show; and ``detail``, one masked line of the underlying error for
the operator (CLI, server log). A probe never raises: every failure, expected or not, is a failed check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import migrate
from celery_outbox.config.masking import mask_secrets
from celery_outbox.errors import ConfigError
from celery_outbox.schema import DEFAULT_PREFIX, check_prefix

CheckName = Literal["database", "schema", "broker"]
# The only words a check's public ``reason`` can hold: an HTTP answer is built from these and the
# check names, never from an exception's text, so no host, port, user or driver message can leak.
Reason = Literal["ok", "unreachable", "not migrated", "not at head revision", "not checked: database unreachable",
                 "not configured", "failed"]
BrokerProbe = Callable[[], None]  # returns when the broker answered; raises otherwise

_DETAIL_LIMIT = 300


def _detail(error: BaseException) -> str:
    """One line for the operator: the error's class and first line, any URL password masked."""
    if isinstance(error, sa.exc.DBAPIError) and error.orig is not None:
        error = error.orig  # the driver's own words, without SQLAlchemy's SQL and background link
    text = next((ln.strip() for ln in str(error).splitlines() if ln.strip()), "")
    text = mask_secrets(text)
    line = f"{error.__class__.__name__}: {text}" if text else error.__class__.__name__
    return line if len(line) <= _DETAIL_LIMIT else line[: _DETAIL_LIMIT - 3] + "..."


@dataclass(frozen=True, kw_only=True)
class Check:
    name: CheckName
    ok: bool
    reason: Reason
    detail: str = ""  # for the operator only: never put it in an HTTP answer

    def line(self) -> str:
        """``broker: unreachable (OperationalError: ...)``: what the CLI prints for a failed check."""
        return f"{self.name}: {self.reason}" + (f" ({self.detail})" if self.detail else "")


@dataclass(frozen=True)
class Readiness:
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def public_dict(self) -> dict[str, Any]:
        """What an unauthenticated probe may see: check names and fixed reasons only."""
        return {"status": "ready" if self.ok else "not ready",
                "checks": {c.name: c.reason for c in self.checks},
                "failed": [c.name for c in self.failed]}

    def to_dict(self) -> dict[str, Any]:
        """The operator's view (``outbox check --json``): the public view plus each check's detail."""
        return {"ready": self.ok,
                "checks": [{"name": c.name, "ok": c.ok, "reason": c.reason, "detail": c.detail} for c in self.checks],
                "failed": [c.name for c in self.failed]}


@functools.cache
def head_revision() -> str | None:
    """The library's newest migration (read once per process: it cannot change under a running process)."""
    return migrate.head()


def _database_and_schema(session_factory: sessionmaker[Session], prefix: str,
                         upgrade_command: str) -> tuple[Check, Check]:
    from alembic.runtime.migration import MigrationContext

    version_table = f"{check_prefix(prefix)}schema_version"  # Tables.version_table, without mapping the tables
    try:
        with session_factory() as session:
            session.execute(sa.text("SELECT 1"))
            database = Check(name="database", ok=True, reason="ok")
            try:
                revision = MigrationContext.configure(session.connection(), opts={"version_table": version_table}) \
                    .get_current_revision()
            except Exception as e:  # the query failed although the database answered SELECT 1
                return database, Check(name="schema", ok=False, reason="failed", detail=_detail(e))
            finally:
                session.rollback()
    except Exception as e:
        return (Check(name="database", ok=False, reason="unreachable", detail=_detail(e)),
                Check(name="schema", ok=False, reason="not checked: database unreachable"))
    head = head_revision()
    if revision is None:
        schema = Check(name="schema", ok=False, reason="not migrated",
                       detail=f"no {version_table} revision: run '{upgrade_command}'")
    elif revision != head:
        schema = Check(name="schema", ok=False, reason="not at head revision",
                       detail=f"revision {revision}, this library needs {head}: run '{upgrade_command}'")
    else:
        schema = Check(name="schema", ok=True, reason="ok", detail=f"revision {revision}")
    return database, schema


def _broker(probe: BrokerProbe) -> Check:
    try:
        probe()
    except ConfigError as e:
        return Check(name="broker", ok=False, reason="not configured", detail=_detail(e))
    except Exception as e:
        return Check(name="broker", ok=False, reason="unreachable", detail=_detail(e))
    return Check(name="broker", ok=True, reason="ok")


def readiness(session_factory: sessionmaker[Session], *, prefix: str = DEFAULT_PREFIX,
              broker: BrokerProbe | None = None, upgrade_command: str = "outbox db upgrade") -> Readiness:
    """Database reachable (``SELECT 1``), schema of ``prefix`` at the library's head revision, and,
    when ``broker`` is given, the broker reachable. A dependency that fails is a failed check, never an
    exception; read ``.ok`` and ``.failed``. A schema behind says to run ``upgrade_command``
    (``Outbox.schema_command``: a Django project's ``python manage.py migrate``)."""
    checks = list(_database_and_schema(session_factory, prefix, upgrade_command))
    if broker is not None:
        checks.append(_broker(broker))
    return Readiness(tuple(checks))
