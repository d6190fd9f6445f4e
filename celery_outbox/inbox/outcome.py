"""What handling one delivery came to."""

from __future__ import annotations

import enum


class Outcome(enum.Enum):
    PROCESSED = "processed"  # effect and inbox row committed together
    DUPLICATE = "duplicate"  # inbox already had (message_id, consumer): effect rolled back / skipped
    STALE = "stale"  # per-entity ordering: a version this consumer already passed
    PARKED = "parked"  # per-entity ordering: arrived early, waits for the gap to fill
    RETRY = "retry"  # failed, will be redelivered
    DEAD_LETTERED = "dead_lettered"  # failed max deliveries (or is malformed): in the dead-letter store
