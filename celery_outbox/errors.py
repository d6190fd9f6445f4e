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


class EmbeddedServerError(OutboxError):
    """The embedded Redis server could not be started or reached."""


class NotFoundError(ValidationError):
    """A caller named something (a dead-letter id, a consumer) that does not exist; nothing changed."""


class ArchiveError(ValidationError):
    """The file a purge archives to cannot keep the dead letters (a device, a directory, not an archive, a
    full disk): the purge stops before deleting anything it has not written there."""


class TransactionRequiredError(OutboxError):
    """An outbox row was to be written outside a transaction (autocommit would publish rolled-back work)."""


class AlreadyPublishedError(OutboxError):
    """A cancel named a task the relay has already published: the outbox can no longer stop it."""
