"""Per-entity ordering, opt-in per consumer: skip versions already passed, park early ones.

An event opts in with headers ``entity_key`` + ``entity_version`` (1, 2, 3, ...). All deliveries of
one entity for one consumer serialise on that entity's ``EntityVersion`` row (``FOR UPDATE`` on
Postgres; SQLite's ``BEGIN IMMEDIATE`` serialises everything), so "is the gap filled?" is never a
race. A version at or below the applied one is STALE (recorded in the inbox, no effect); the next
version is applied, then any parked successors in order; a later one is PARKED (no inbox row, so a
timed-out parked message can be dead-lettered and replayed through the same path).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.orm import Session

from celery_outbox.db import is_postgres, is_unique_violation, wrap_driver_errors
from celery_outbox.errors import DatabaseError
from celery_outbox.inbox import dead_letters
from celery_outbox.inbox.claim import DuplicateDelivery, Handler, claim, claim_if_absent
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope, encode_json
from celery_outbox.schema import Tables
from celery_outbox.sql import upsert


def entity_of(envelope: Envelope) -> tuple[str, int] | None:
    """``(entity_key, entity_version)`` when the event opted in, else None (no ordering applies)."""
    key = envelope.headers.get("entity_key")
    version = envelope.headers.get("entity_version")
    if not isinstance(key, str) or not key or isinstance(version, bool) or not isinstance(version, int):
        return None
    return key, version


def _lock_entity(session: Session, consumer: str, key: str, *, tables: Tables) -> int:
    """Create the entity's version row if needed and lock it; returns the applied version (0 = none)."""
    session.execute(upsert(session, tables.entity_versions, {"consumer": consumer, "entity_key": key, "version": 0},
                           keys=("consumer", "entity_key")))
    stmt = sa.select(tables.entity_versions.version).where(tables.entity_versions.consumer == consumer,
                                                  tables.entity_versions.entity_key == key)
    if is_postgres(session):
        stmt = stmt.with_for_update()
    return int(session.execute(stmt).scalar_one())


def apply(session: Session, envelope: Envelope, *, tables: Tables, consumer: str, handler: Handler, now_ms: int) -> Outcome:
    """The ordering branch of ``inbox.handle``: runs inside its transaction, never commits."""
    entity = entity_of(envelope)
    if entity is None:
        claim(session, envelope, tables=tables, consumer=consumer, now_ms=now_ms)
        handler(session, envelope)
        return Outcome.PROCESSED
    key, version = entity
    with wrap_driver_errors(f"locking entity {key!r} for {consumer}"):
        current = _lock_entity(session, consumer, key, tables=tables)
        parked_already = session.get(tables.parked, (envelope.message_id, consumer)) is not None
    if parked_already:
        raise DuplicateDelivery(f"{envelope.message_id}/{consumer}")
    if version <= current:
        claim(session, envelope, tables=tables, consumer=consumer, now_ms=now_ms)
        return Outcome.STALE
    if version > current + 1:
        session.add(tables.parked(message_id=envelope.message_id, consumer=consumer, entity_key=key,
                                  entity_version=version, envelope=envelope.to_dict(), parked_at_ms=now_ms))
        try:
            session.flush()
        except exc.IntegrityError as e:
            if is_unique_violation(e):
                raise DuplicateDelivery(f"{envelope.message_id}/{consumer}") from None
            raise DatabaseError(f"parking {envelope.message_id} for {consumer} failed: {e.orig}") from e
        return Outcome.PARKED
    claim(session, envelope, tables=tables, consumer=consumer, now_ms=now_ms)
    handler(session, envelope)
    current = version
    current = _drain_parked(session, tables=tables, consumer=consumer, key=key, current=current, handler=handler, now_ms=now_ms)
    session.execute(sa.update(tables.entity_versions)
                    .where(tables.entity_versions.consumer == consumer, tables.entity_versions.entity_key == key)
                    .values(version=current))
    return Outcome.PROCESSED


def _drain_parked(session: Session, *, tables: Tables, consumer: str, key: str, current: int, handler: Handler,
                  now_ms: int) -> int:
    """Apply parked successors while the next version is there; drop parked ones now stale."""
    parked = session.execute(
        sa.select(tables.parked).where(tables.parked.consumer == consumer, tables.parked.entity_key == key)
        .order_by(tables.parked.entity_version, tables.parked.message_id)
    ).scalars().all()
    for row in parked:
        if row.entity_version > current + 1:
            break
        env = Envelope.from_dict(row.envelope)
        fresh = claim_if_absent(session, env, tables=tables, consumer=consumer, now_ms=now_ms)
        if fresh and row.entity_version == current + 1:
            handler(session, env)
            current = row.entity_version
        session.delete(row)
    return current


def expire_parked(session: Session, *, tables: Tables, consumer: str, now_ms: int, timeout_ms: int) -> int:
    """Dead-letter parked messages older than ``timeout_ms`` (the gap never filled); commits.

    Returns how many were moved. Replaying one re-enters the ordering path (it parks again if
    the gap is still open).
    """
    cutoff = now_ms - timeout_ms
    with wrap_driver_errors(f"expiring parked messages of {consumer}"):
        rows = session.execute(
            sa.select(tables.parked).where(tables.parked.consumer == consumer, tables.parked.parked_at_ms <= cutoff)
            .order_by(tables.parked.parked_at_ms)
        ).scalars().all()
        for row in rows:
            current = session.execute(
                sa.select(tables.entity_versions.version).where(tables.entity_versions.consumer == consumer,
                                                       tables.entity_versions.entity_key == row.entity_key)
            ).scalar_one_or_none() or 0
            envelope: dict[str, Any] = dict(row.envelope)
            dead_letters.record(
                session, tables=tables, consumer=consumer, message_id=str(row.message_id), type=envelope.get("type"),
                body=encode_json(envelope, what="parked envelope"), headers=dict(envelope.get("headers") or {}),
                delivery_count=1,
                last_error=(f"parked {now_ms - row.parked_at_ms} ms waiting for version {current + 1} of entity "
                            f"{row.entity_key!r} (this is version {row.entity_version}); timed out after "
                            f"{timeout_ms} ms"),
                first_failed_at_ms=row.parked_at_ms, last_failed_at_ms=now_ms,
            )
            session.delete(row)
        session.commit()
    return len(rows)
