"""One exception tree for the whole package.

Driver errors (psycopg2, sqlite3, kombu, redis) are wrapped at the adapter that sees them, so
callers catch ``OutboxError`` subclasses and read a message that says what to do next.
"""

from __future__ import annotations


class OutboxError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(OutboxError):
    """A setting from the environment (or a CLI flag) is missing or malformed."""


class ValidationError(OutboxError):
    """Input from a caller (HTTP body, CLI argument, event) does not fit the contract."""


class DatabaseError(OutboxError):
    """The database refused or failed a statement; the original driver error is ``__cause__``."""


class SerializationError(OutboxError):
    """An event payload or header cannot be encoded as JSON (we never fall back to pickle)."""


class MessageTooLargeError(OutboxError):
    """An encoded message is larger than ``max_message_bytes``."""


class UnknownEventTypeError(OutboxError):
    """No consumer route exists for an event type."""


class MalformedMessageError(OutboxError):
    """A delivered message is not a valid envelope (bad JSON, missing fields, wrong types)."""


class PublishError(OutboxError):
    """Publishing failed. Subclasses say whose fault it was, which decides the relay's reaction."""


class MessageRejectedError(PublishError):
    """The broker refused THIS message (nack, returned, unroutable): counts toward its attempts."""


class BrokerUnavailableError(PublishError):
    """The broker cannot be reached at all: a relay-wide condition, never charged to a message."""


class NotFoundError(ValidationError):
    """A caller named something (a dead-letter id, a consumer) that does not exist; nothing changed."""


class ArchiveError(ValidationError):
    """The file a purge archives to cannot keep the dead letters (a device, a directory, not an archive, a
    full disk): the purge stops before deleting anything it has not written there."""


class TransactionRequiredError(OutboxError):
    """An outbox row was to be written outside a transaction (autocommit would publish rolled-back work)."""


class AlreadyPublishedError(OutboxError):
    """A cancel named a task the relay has already published: the outbox can no longer stop it."""


class MissingExtraError(ConfigError, ImportError):
    """An optional dependency is not installed. The message is one line naming the extra that installs it
    (``pip install "celery-outbox[redis]"``); an ``ImportError`` too, so ``except ImportError`` still sees it."""


#: The top-level module of each optional dependency -> the extra of ``celery-outbox`` that installs it
#: (pyproject.toml, ``[project.optional-dependencies]``; tests/structure/test_optional_imports.py keeps the two in step).
EXTRAS: dict[str, str] = {
    "redis": "redis",
    "psycopg2": "psycopg2",
    "psycopg": "psycopg",
    "flask": "flask",
    "gunicorn": "flask",
    "django": "django",
    "opentelemetry": "otel",
}


def missing_extra(module: str | None, *, needed_by: str, install: str | None = None) -> MissingExtraError:
    """The one-line error for ``module`` missing where ``needed_by`` needs it; ``install`` overrides the
    ``pip install`` arguments (default: the extra of ``EXTRAS`` that installs the module)."""
    top = (module or "").split(".")[0]
    if install is None:
        install = f'"celery-outbox[{EXTRAS[top]}]"' if top in EXTRAS else f'"{top}"'
    return MissingExtraError(f"{needed_by} needs {module!r}, which is not installed: pip install {install}", name=top)
