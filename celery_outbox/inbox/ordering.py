"""Per-entity ordering, opt-in per consumer: skip versions already passed, park early ones.

An event opts in with headers ``entity_key`` + ``entity_version`` (1, 2, 3, ...). All deliveries of
one entity for one consumer serialise on that entity's ``EntityVersion`` row (an upsert that locks
it: ``ON CONFLICT DO UPDATE`` on Postgres; SQLite's ``BEGIN IMMEDIATE`` serialises everything), so
"is the gap filled?" is never a race. A version at or below the applied one is STALE (recorded in the
inbox, no effect); the next version is applied, then any parked successors in order; a later one is
PARKED (no inbox row, so a timed-out parked message can be dead-lettered and replayed through the
same path).

Statement budget of the happy path (the next version), all in the delivery's one transaction
(inbox/handle.py): the inbox claim; ONE statement that both records and locks the new version when it
is the next one (``INSERT ... ON CONFLICT DO NOTHING`` of version 1 for an entity never seen, else
``UPDATE ... WHERE version = <this one - 1>``); the effect. The entity's parked messages are read (one
statement, then the successors applied and the version row written again) only when the entity may have
some. Only when that first statement changes nothing (an early, stale or concurrent delivery) does the
locking upsert find the applied version, and a version update follow.

Whether an entity may have parked messages is its row's ``parked`` marker (0: none). A message is parked
only by a transaction that holds the entity's row (``_lock_entity`` creates it when missing), and that
transaction's locking statement sets the marker (so does the parked table's trigger, ``schema.parked_trigger``,
for a worker of the release before, whose lock does not); a transaction that holds the row, has read the entity's
parked messages and applied or dropped those it could, writes the marker from what is left. So a delivery
that holds the row reads a marker no parked message can contradict: ``UPDATE ... RETURNING`` waits for a
concurrent holder and returns the row it committed. Anything else that deletes parked messages (their
expiry, a person) leaves the marker set: it only costs the entity's next delivery one read, which clears it.

Version 1 of an entity never seen skips the read of the entity's parked messages: there cannot be
any. A parked message of an entity comes with a committed row of that entity, and an insert of the row
that inserts it (no conflict, after waiting for any concurrent inserter) proves no such row ever
committed; it writes the marker clear. Entity rows are never deleted. The question of the consumer's
expired parked messages rides on the statement that records the version (its ``RETURNING``: a read in
the statement's snapshot is enough for it, as a parked message missed now is found by a later delivery),
else it is one cheap read, or part of the read of the entity's parked messages.
"""

from __future__ import annotations

from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_outbox.db import wrap_driver_errors
from celery_outbox.entity_headers import entity_problem
from celery_outbox.errors import MalformedMessageError
from celery_outbox.inbox import dead_letters
from celery_outbox.inbox.claim import (
    DuplicateDelivery,
    Handler,
    claim_if_absent,
    driver_sql,
    execute_driver_sql,
    insert_values,
)
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope, encode_json
from celery_outbox.schema import Tables
from celery_outbox.sql import insert_for, insert_if_absent, statement


def entity_of(envelope: Envelope) -> tuple[str, int] | None:
    """``(entity_key, entity_version)`` when the event opted in, None when it carries neither header (no ordering
    applies). Headers an ordered consumer cannot apply (``entity_headers.entity_problem``: the writer's own rule) are
    a malformed message, dead-lettered with its reason after the consumer's deliveries, the same on every
    database: never applied without ordering, never taken as stale (no effect, no dead letter)."""
    key = envelope.headers.get("entity_key")
    version = envelope.headers.get("entity_version")
    if (problem := entity_problem(key, version)) is not None:
        raise MalformedMessageError(problem)
    if key is None:
        return None
    return cast(str, key), cast(int, version)  # entity_problem checked both


def _lock_entity(session: Session, consumer: str, key: str, version: int, *, tables: Tables) -> tuple[int, bool]:
    """Create the entity's version row if needed and lock it, in one statement; returns the applied
    version (0 = none) and whether the entity may have parked messages. ``DO UPDATE`` takes the row lock
    that ``DO NOTHING`` would not, and waits for a concurrent holder, then returns the row it committed.

    The same statement sets the parked marker when ``version`` (the delivery's) is beyond the next one, as
    the delivery then parks; a row it creates is marked too (no version 1 locks a missing row: ``_create``
    inserted it or found it committed)."""
    table = tables.table(tables.entity_versions)
    connection, stmt = statement(session, ("lock_entity", table), lambda: (
        insert_for(session, table)
        .values(consumer=sa.bindparam("b_consumer"), entity_key=sa.bindparam("b_key"), version=0, parked=1)
        .on_conflict_do_update(index_elements=["consumer", "entity_key"], set_={
            "parked": sa.case((sa.bindparam("b_version", type_=sa.BigInteger) > table.c.version + 1, 1),
                              else_=table.c.parked)})
        .returning(table.c.version, table.c.parked)))
    applied, parked = connection.execute(stmt, {"b_consumer": consumer, "b_key": key, "b_version": version}).one()
    return int(applied), bool(parked)


def _set_version(session: Session, consumer: str, key: str, version: int, *, parked: bool, tables: Tables) -> None:
    """Write the entity's applied version and its parked marker (the caller holds the row)."""
    table = tables.table(tables.entity_versions)
    connection, stmt = statement(session, ("set_version", table), lambda: (
        sa.update(table).where(table.c.consumer == sa.bindparam("b_consumer"),
                               table.c.entity_key == sa.bindparam("b_key"))
        .values(version=sa.bindparam("b_version"), parked=sa.bindparam("b_parked"))))
    connection.execute(stmt, {"b_consumer": consumer, "b_key": key, "b_version": version, "b_parked": int(parked)})


def _create(session: Session, consumer: str, key: str, *, tables: Tables,
            cutoff_ms: int | None) -> tuple[bool, bool]:
    """Record version 1 of an entity never seen (``INSERT ... ON CONFLICT DO NOTHING``): ``(created,
    expired)``, ``expired`` being whether the consumer has parked messages parked at or before
    ``cutoff_ms``, asked only when the row was created (module docstring); a concurrent inserter is
    waited for, then the row is not created."""
    table = tables.table(tables.entity_versions)
    values = {"consumer": consumer, "entity_key": key, "version": 1, "parked": 0}
    connection = session.connection()
    if cutoff_ms is None:
        sql = driver_sql(connection, ("create_entity", table), lambda: (
            insert_values(table, ("consumer", "entity_key", "version", "parked"))
            .on_conflict_do_nothing(index_elements=["consumer", "entity_key"])))
        if sql is None:
            return insert_if_absent(session, table, ("consumer", "entity_key"), values), False
        return execute_driver_sql(connection, sql, values).rowcount == 1, False
    sql = driver_sql(connection, ("create_entity_expired", table), lambda: (
        insert_values(table, ("consumer", "entity_key", "version", "parked"))
        .on_conflict_do_nothing(index_elements=["consumer", "entity_key"])
        .returning(_expired_exists(tables))))
    if sql is None:
        created = insert_if_absent(session, table, ("consumer", "entity_key"), values)
        return created, created and has_expired(session, tables=tables, consumer=consumer, cutoff_ms=cutoff_ms)
    row = execute_driver_sql(connection, sql, {**values, "b_consumer": consumer, "b_cutoff": cutoff_ms}).first()
    return row is not None, row is not None and bool(row[0])


def _expired_exists(tables: Tables) -> Any:
    """``EXISTS`` (a column of a ``RETURNING``): the consumer has a parked message parked at or before the cutoff."""
    parked = tables.table(tables.parked)
    return (sa.select(sa.literal_column("1")).where(parked.c.consumer == sa.bindparam("b_consumer"),
                                                    parked.c.parked_at_ms <= sa.bindparam("b_cutoff"))
            .exists().label("expired"))


def _advance(session: Session, consumer: str, key: str, version: int, *, tables: Tables,
             cutoff_ms: int | None = None) -> tuple[bool, bool] | None:
    """Record ``version`` (2 or more) as applied if it is the next one, in one statement that also locks
    the row; when it did, ``(parked, expired)``: the entity's parked marker, and whether the consumer has
    parked messages parked at or before ``cutoff_ms`` (False without one). None says nothing yet (the row
    may be missing, behind, ahead or locked by a delivery that has since moved it): the caller locks and
    reads it (``_lock_entity``).

    Under READ COMMITTED an ``UPDATE`` whose row a concurrent transaction holds waits, then re-checks
    its condition on the committed row and returns that row, so it never advances from a version that has
    changed nor misses a marker a delivery that parked has committed.
    """
    table = tables.table(tables.entity_versions)
    params: dict[str, Any] = {"b_consumer": consumer, "b_key": key, "b_previous": version - 1, "b_version": version}
    if cutoff_ms is not None:
        params["b_cutoff"] = cutoff_ms
    cache_key = ("advance_version" if cutoff_ms is None else "advance_version_expired", table)

    def build() -> Any:
        stmt = (sa.update(table).where(table.c.consumer == sa.bindparam("b_consumer"),
                                       table.c.entity_key == sa.bindparam("b_key"),
                                       table.c.version == sa.bindparam("b_previous"))
                .values(version=sa.bindparam("b_version")))
        if cutoff_ms is None:
            return stmt.returning(table.c.parked)
        return stmt.returning(table.c.parked, _expired_exists(tables))

    connection = session.connection()
    sql = driver_sql(connection, cache_key, build)
    row: Any
    if sql is not None:
        row = execute_driver_sql(connection, sql, params).first()
    else:
        connection, stmt = statement(session, cache_key, build)
        row = connection.execute(stmt, params).first()
    if row is None:
        return None
    return bool(row[0]), cutoff_ms is not None and bool(row[1])


def apply(session: Session, envelope: Envelope, *, tables: Tables, consumer: str, handler: Handler, now_ms: int,
          expire_cutoff_ms: int | None = None) -> tuple[Outcome, bool]:
    """The ordering branch of ``inbox.handle``: runs inside its transaction, never commits.

    Returns the outcome (DUPLICATE, with nothing written, when the inbox already holds the key) and,
    with ``expire_cutoff_ms``, whether the consumer has parked messages parked at or before it (for
    ``expire_parked`` after the commit). Raises ``DuplicateDelivery`` when the message is already
    parked (the caller rolls back).
    """
    if not claim_if_absent(session, envelope, tables=tables, consumer=consumer, now_ms=now_ms):
        return Outcome.DUPLICATE, False
    entity = entity_of(envelope)
    if entity is None:
        handler(session, envelope)
        return Outcome.PROCESSED, _has_expired(session, tables, consumer, expire_cutoff_ms)
    key, version = entity
    # whether the consumer has expired parked messages: None until a statement has answered it
    expired: bool | None = None
    with wrap_driver_errors(f"locking entity {key!r} for {consumer}"):
        if version == 1:
            created, expired = _create(session, consumer, key, tables=tables, cutoff_ms=expire_cutoff_ms)
            if created:  # nothing of this entity can be parked (module docstring): no read of it
                handler(session, envelope)
                return Outcome.PROCESSED, expired
            advanced, expired = None, None
        else:
            advanced = _advance(session, consumer, key, version, tables=tables, cutoff_ms=expire_cutoff_ms)
        if advanced is not None:
            current, (marked, expired) = version - 1, advanced
        else:
            current, marked = _lock_entity(session, consumer, key, version, tables=tables)
    if version <= current:
        return Outcome.STALE, _has_expired(session, tables, consumer, expire_cutoff_ms)  # claim kept: no effect
    if version > current + 1:
        with wrap_driver_errors(f"parking {envelope.message_id} for {consumer}"):
            parked = insert_if_absent(session, tables.table(tables.parked), ("message_id", "consumer"), {
                "message_id": envelope.message_id, "consumer": consumer, "entity_key": key, "entity_version": version,
                "envelope": envelope.to_dict(), "parked_at_ms": now_ms,
            })
            if not parked:
                raise DuplicateDelivery(f"{envelope.message_id}/{consumer}")
            # A parked message has no inbox row (module docstring): give back the claim.
            inbox = tables.table(tables.inbox)
            session.execute(sa.delete(inbox).where(inbox.c.message_id == envelope.message_id,
                                                   inbox.c.consumer == consumer))
        return Outcome.PARKED, _has_expired(session, tables, consumer, expire_cutoff_ms)
    handler(session, envelope)
    applied, left = version, 0
    with wrap_driver_errors(f"advancing entity {key!r} for {consumer}"):
        if marked:  # the entity may have parked messages (module docstring): read them, apply the successors
            cutoff = expire_cutoff_ms if expired is None else None
            rows = _parked_rows(session, tables, consumer, key, cutoff)
            applied, left = _drain_parked(session, [r for r in rows if r.entity_key == key], tables=tables,
                                          consumer=consumer, current=version, handler=handler, now_ms=now_ms)
            if cutoff is not None:
                expired = any(r.entity_key != key and r.parked_at_ms <= cutoff for r in rows)
        if advanced is None or applied != version or (left > 0) != marked:
            _set_version(session, consumer, key, applied, parked=left > 0, tables=tables)
    if expired is None:
        expired = _has_expired(session, tables, consumer, expire_cutoff_ms)
    return Outcome.PROCESSED, expired


def _has_expired(session: Session, tables: Tables, consumer: str, cutoff_ms: int | None) -> bool:
    if cutoff_ms is None:
        return False
    with wrap_driver_errors(f"looking for expired parked messages of {consumer}"):
        return has_expired(session, tables=tables, consumer=consumer, cutoff_ms=cutoff_ms)


def has_expired(session: Session, *, tables: Tables, consumer: str, cutoff_ms: int) -> bool:
    """True when ``consumer`` has a parked message parked at or before ``cutoff_ms`` (one cheap read)."""
    table = tables.table(tables.parked)
    connection, stmt = statement(session, ("has_expired", table), lambda: (
        sa.select(sa.literal(1)).where(table.c.consumer == sa.bindparam("b_consumer"),
                                       table.c.parked_at_ms <= sa.bindparam("b_cutoff")).limit(1)))
    return connection.execute(stmt, {"b_consumer": consumer, "b_cutoff": cutoff_ms}).first() is not None


def _parked_rows(session: Session, tables: Tables, consumer: str, key: str, cutoff_ms: int | None) -> list[Any]:
    """The consumer's parked messages of entity ``key`` and, with ``cutoff_ms``, those parked at or before it
    (one read for both questions), in version order."""
    table = tables.table(tables.parked)
    columns = (table.c.message_id, table.c.entity_key, table.c.entity_version, table.c.envelope, table.c.parked_at_ms)
    mine = table.c.entity_key == sa.bindparam("b_key")
    if cutoff_ms is None:
        connection, stmt = statement(session, ("parked_of_entity", table), lambda: (
            sa.select(*columns).where(table.c.consumer == sa.bindparam("b_consumer"), mine)
            .order_by(table.c.entity_version, table.c.message_id)))
        return list(connection.execute(stmt, {"b_consumer": consumer, "b_key": key}).all())
    connection, stmt = statement(session, ("parked_of_entity_or_expired", table), lambda: (
        sa.select(*columns).where(table.c.consumer == sa.bindparam("b_consumer"),
                                  sa.or_(mine, table.c.parked_at_ms <= sa.bindparam("b_cutoff")))
        .order_by(table.c.entity_version, table.c.message_id)))
    return list(connection.execute(stmt, {"b_consumer": consumer, "b_key": key, "b_cutoff": cutoff_ms}).all())


def _drain_parked(session: Session, rows: list[Any], *, tables: Tables, consumer: str, current: int,
                  handler: Handler, now_ms: int) -> tuple[int, int]:
    """Apply parked successors (``rows``: the entity's, in version order) while the next version is
    there; drop parked ones now stale. Returns the version applied last and how many rows are left parked."""
    table = tables.table(tables.parked)
    for done, row in enumerate(rows):
        if row.entity_version > current + 1:
            return current, len(rows) - done
        env = Envelope.from_dict(row.envelope)
        fresh = claim_if_absent(session, env, tables=tables, consumer=consumer, now_ms=now_ms)
        if fresh and row.entity_version == current + 1:
            handler(session, env)
            current = row.entity_version
        session.execute(sa.delete(table).where(table.c.message_id == row.message_id, table.c.consumer == consumer))
    return current, 0


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
