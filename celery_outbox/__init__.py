"""Transactional outbox, inbox and idempotent consumers on Celery: at-least-once delivery, effect once.

Everything an application needs is named here; deeper modules are the implementation. Importing this
package starts nothing, connects to nothing and reads no environment.
"""

from __future__ import annotations

from celery_outbox.cancel import Cancelled
from celery_outbox.celery.config import recommended_celery_config
from celery_outbox.clock import Clock, ManualClock, SystemClock
from celery_outbox.config.declare import redeclare, setting
from celery_outbox.config.masking import exit_on_config_error
from celery_outbox.config.rules import IntRule, PathRule
from celery_outbox.consumer import ConsumerRegistry, ConsumerSpec, consumer
from celery_outbox.crashpoints import CrashPoints
from celery_outbox.db import is_unique_violation, make_engine, wrap_driver_errors
from celery_outbox.errors import (
    AlreadyPublishedError,
    BrokerUnavailableError,
    ConfigError,
    DatabaseError,
    MalformedMessageError,
    MessageRejectedError,
    MessageTooLargeError,
    MissingExtraError,
    NotFoundError,
    OutboxError,
    PublishError,
    SerializationError,
    TransactionRequiredError,
    UnknownEventTypeError,
    ValidationError,
)
from celery_outbox.inbox.claim import effect_now_ms
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.migrate import alembic_filters
from celery_outbox.migrate import check as check_database
from celery_outbox.migrate import upgrade as migrate_database
from celery_outbox.outbox import Outbox
from celery_outbox.policy import RetryPolicy
from celery_outbox.relay.publisher import Publisher, PublishReport
from celery_outbox.schema import Tables, define_tables
from celery_outbox.settings import Settings
from celery_outbox.sql import upsert
from celery_outbox.version import package_version
from celery_outbox.writer import Event

__version__ = package_version()

__all__ = [
    "AlreadyPublishedError",
    "BrokerUnavailableError",
    "Cancelled",
    "Clock",
    "ConfigError",
    "ConsumerRegistry",
    "ConsumerSpec",
    "CrashPoints",
    "DatabaseError",
    "Envelope",
    "Event",
    "IntRule",
    "MalformedMessageError",
    "ManualClock",
    "MessageRejectedError",
    "MessageTooLargeError",
    "MissingExtraError",
    "NotFoundError",
    "Outbox",
    "OutboxError",
    "Outcome",
    "PathRule",
    "PublishError",
    "PublishReport",
    "Publisher",
    "RetryPolicy",
    "SerializationError",
    "Settings",
    "SystemClock",
    "Tables",
    "TransactionRequiredError",
    "UnknownEventTypeError",
    "ValidationError",
    "alembic_filters",
    "check_database",
    "consumer",
    "define_tables",
    "effect_now_ms",
    "exit_on_config_error",
    "is_unique_violation",
    "make_engine",
    "migrate_database",
    "recommended_celery_config",
    "redeclare",
    "setting",
    "upsert",
    "wrap_driver_errors",
]
