"""The inbox key of an idempotent Celery task (``@outbox.task``): its ``consumer`` column, and its message id.

An idempotent task shares the consumer machinery (inbox, delivery counts, dead-letter store, counters),
so it needs a ``consumer`` value: a stable function of the task name that fits the 64-character
columns and can never equal a consumer's name (consumer names are letters, digits, ``_`` and ``-``
only, so any key holding ``:`` or ``#`` is a task's):

* ``task:<name>`` when that fits in 64 characters and the name is plain printable text;
* otherwise ``task#<first 42 characters of the name>~<16 hex digits of SHA-256(name)>``.

The two forms start differently, so a short name can never collide with a hashed long one. The key
is part of the stored data: renaming a task changes its key (its inbox rows no longer guard it).

The inbox row's ``message_id`` is the Celery task id when it is a UUID (``apply_async`` makes one),
else a UUID derived from it (a caller-chosen ``task_id="invoice-42"``): the same task id always maps
to the same key.
"""

from __future__ import annotations

import hashlib
import uuid

from celery_outbox.errors import ConfigError
from celery_outbox.messages import TASK_ID_NAMESPACE, TYPE_MAX_CHARS, is_storable

KEY_MAX_CHARS = 64  # the width of every ``consumer`` column
PLAIN_PREFIX = "task:"
HASHED_PREFIX = "task#"
_DIGEST_CHARS = 16
_HEAD_CHARS = KEY_MAX_CHARS - len(HASHED_PREFIX) - 1 - _DIGEST_CHARS


def task_key(name: str) -> str:
    """The ``consumer`` value under which the idempotent task ``name`` records its inbox rows."""
    plain = PLAIN_PREFIX + name
    if len(plain) <= KEY_MAX_CHARS and is_storable(name) and name.isprintable():
        return plain
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]
    head = "".join(c if c.isprintable() and is_storable(c) else "?" for c in name[:_HEAD_CHARS])
    return f"{HASHED_PREFIX}{head}~{digest}"


def is_task_key(consumer: str) -> bool:
    """True when ``consumer`` is an idempotent task's key, never a consumer's name."""
    return consumer.startswith((PLAIN_PREFIX, HASHED_PREFIX))


def message_id_for(task_id: str) -> uuid.UUID:
    """The inbox ``message_id`` of Celery task id ``task_id`` (the id itself when it is a UUID)."""
    try:
        return uuid.UUID(task_id)
    except ValueError:
        return uuid.uuid5(TASK_ID_NAMESPACE, "celery-task-id:" + task_id.encode("utf-8", "surrogatepass").hex())


def check_task_name(name: object) -> str:
    """A task name is stored as the ``type`` of its inbox rows and dead letters: printable, bounded."""
    if not isinstance(name, str) or not name or len(name) > TYPE_MAX_CHARS or not name.isprintable() \
            or not is_storable(name):
        raise ConfigError(f"an idempotent task needs a name of 1-{TYPE_MAX_CHARS} printable characters, "
                          f"got {name!r:.80}")
    return name
