"""Per-entity ordering headers (``entity_key``, ``entity_version``): what every ordered consumer can apply.

One rule for the two places that judge them: the writer refuses an event whose headers break it (writer.py), and
an ordered consumer dead-letters a delivery whose headers break it as malformed (inbox/ordering.py), so an event
the writer accepted is one every ordered consumer applies, and one a hostile producer put on a queue ends the
same way on every database.
"""

from __future__ import annotations

from typing import Any

from celery_outbox.messages import is_storable

ENTITY_KEY_MAX_CHARS = 200  # the entity_key columns (parked events, applied entity versions: schema.py)
MAX_ENTITY_VERSION = 2**63 - 1  # the entity version columns are 64-bit


def entity_problem(key: Any, version: Any) -> str | None:
    """What is wrong with per-entity ordering headers (``entity_key``, ``entity_version``), None when they are
    fine or both absent: the one rule of the writer (which refuses such an event) and of an ordered consumer
    (which dead-letters such a delivery as malformed: inbox/ordering.py). Every ordered consumer can store a
    key of 1 to ``ENTITY_KEY_MAX_CHARS`` printable characters and a version from 1 to 2**63-1; anything else
    would be dead-lettered late or differently per database, or would turn ordering off without a word."""
    if key is None:
        return None if version is None else "entity_version is set without entity_key: per-entity ordering needs both"
    if (not isinstance(key, str) or not key or len(key) > ENTITY_KEY_MAX_CHARS or not key.isprintable()
            or not is_storable(key)):
        return (f"entity_key must be 1-{ENTITY_KEY_MAX_CHARS} printable characters, got {type(key).__name__} "
                f"of length {len(key) if isinstance(key, str) else '-'}")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_ENTITY_VERSION:
        return "entity_version must be a positive integer (at most 2**63-1) when entity_key is set"
    return None
