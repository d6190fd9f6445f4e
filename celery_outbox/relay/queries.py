"""The relay's SQL: due pending rows, earliest due first then in seq order (served by the partial index
``ix_outbox_due``), the next due time the relay sleeps until, the Postgres mark that stamps a
batch, counts it and reads the next due time in one statement, and the Postgres claim that does all of
that as it claims (``claim_mark_pg``), with the statement that puts back what the broker did not take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY

from celery_outbox import counters
from celery_outbox.db import LIBPQ_DRIVERS
from celery_outbox.prepared import Prepared
from celery_outbox.schema import PENDING_SQL, Tables

# The columns ``dispatch.claim_due`` copies into a ``ClaimedRow``, in this order.
CLAIM_COLUMNS = ("seq", "message_id", "type", "payload", "headers", "created_at_ms", "attempts")


def due_pending(now_ms: int, limit: int, *, tables: Tables, skip_locked: bool = False) -> sa.Select[Any]:
    """Pending (not published, not dead-lettered) rows that are due, by due time then seq.

    A row is due when its ``next_attempt_at_ms`` has passed: at once for an event or a task sent
    without a delay, at its eta for a task held in the outbox (docs/scheduled.md), after its backoff
    for a row the broker rejected. Ordered by ``(next_attempt_at_ms, seq)``, the columns of the
    partial index ``ix_<prefix>due``, so the claim is a range read of that index that stops at
    ``now`` and the batch's first ``limit`` entries: rows held for later are never read, however
    many there are (bench/scheduled_claim.py). Rows written at once keep their seq order (their due
    time is their creation time). Selects plain columns (Core rows, no ORM objects). The WHERE
    clause repeats the partial index's predicate word for word so the planner can use it; with
    ``skip_locked`` (Postgres) concurrent relays, and the pipelined relay's next batch, claim
    disjoint rows.
    """
    return _due_select(now_ms, limit, tables=tables, skip_locked=skip_locked)


def _due_select(now: Any, limit: Any, *, tables: Tables, skip_locked: bool) -> sa.Select[Any]:
    outbox = tables.table(tables.outbox)
    stmt = (
        sa.select(*(outbox.c[name] for name in CLAIM_COLUMNS))
        .where(
            outbox.c.published_at_ms.is_(None),
            outbox.c.dead_lettered_at_ms.is_(None),
            outbox.c.next_attempt_at_ms <= now,
        )
        .order_by(outbox.c.next_attempt_at_ms, outbox.c.seq)
        .limit(limit)
    )
    if skip_locked:
        stmt = stmt.with_for_update(skip_locked=True)
    return stmt


@dataclass(frozen=True, kw_only=True)
class RelayStatements:
    """The claim, the Postgres mark and the next-due read, built once per relay and executed with
    parameters (docs/benchmarks.md, "The third round: the relay per wake-up").

    Building a statement per wake-up (and SQLAlchemy's cache key of a new statement object) cost more
    client CPU than executing it: ``bench/relay_trickle.py``. The SQL is the same as ``due_pending``'s
    and ``mark_published_pg``'s (``claim`` takes ``now_ms`` and ``claim_limit``), so the claim keeps its
    order, its index and ``SKIP LOCKED`` exactly.
    """

    claim: sa.Select[Any]
    mark: sa.TextClause | None  # None: not Postgres (the mark is built per batch there)
    next_due: sa.Select[Any]  # ``next_due``: read in an empty claim's transaction (dispatch.claim_batch)
    # Postgres through a libpq driver (psycopg 2 or 3): the claim's and the mark's SQL text, compiled once,
    # which ``dispatch`` runs with ``exec_driver_sql`` (no per-execution cache key, compile-cache lookup or
    # type processing; the same statement, round trip and statement events). None: run ``claim``/``mark``.
    claim_sql: str | None = None
    mark_sql: str | None = None
    # The claim that also stamps, counts and reads the next due time (``claim_mark_pg``), compiled once; None:
    # not Postgres through a libpq driver, and the relay claims and marks in two statements.
    claim_mark_sql: str | None = None
    unstamp: sa.TextClause | None = None  # ``unstamp_pg`` (Postgres): the rare path after ``claim_mark_sql``
    # psycopg2 only (psycopg 3 prepares on its own): ``claim_mark_sql`` as a server-side prepared statement,
    # planned once per connection instead of at every wake-up (celery_outbox/prepared.py)
    claim_mark_prepared: Prepared | None = None

    @classmethod
    def build(cls, tables: Tables, dialect: sa.Dialect) -> RelayStatements:
        postgres = dialect.name == "postgresql"
        claim = _due_select(sa.bindparam("now_ms", type_=sa.BigInteger), sa.bindparam("claim_limit", type_=sa.Integer),
                            tables=tables, skip_locked=postgres)
        mark = mark_published_pg(tables, dialect) if postgres else None
        # libpq drivers' own adapters give the claim's columns the types SQLAlchemy's would (a UUID, decoded JSON)
        driver = postgres and dialect.driver in LIBPQ_DRIVERS
        claim_mark_sql = str(claim_mark_pg(tables, dialect).compile(dialect=dialect)) if driver else None
        prepared = Prepared(text=claim_mark_sql, types=CLAIM_MARK_TYPES, label="relay's claim") \
            if claim_mark_sql is not None and dialect.driver == "psycopg2" else None
        return cls(claim=claim, mark=mark, next_due=next_due(tables),
                   claim_sql=str(claim.compile(dialect=dialect)) if driver else None,
                   mark_sql=str(mark.compile(dialect=dialect)) if driver and mark is not None else None,
                   claim_mark_sql=claim_mark_sql, claim_mark_prepared=prepared,
                   unstamp=unstamp_pg(tables, dialect) if postgres else None)


def next_due(tables: Tables) -> sa.Select[Any]:
    """The earliest ``next_attempt_at_ms`` of any pending row (NULL when none): one probe of
    ``ix_<prefix>due``. The standalone relay sleeps no longer than until then (relay/loop.py)."""
    outbox = tables.table(tables.outbox)
    return sa.select(sa.func.min(outbox.c.next_attempt_at_ms)).where(
        outbox.c.published_at_ms.is_(None), outbox.c.dead_lettered_at_ms.is_(None))


def mark_published_pg(tables: Tables, dialect: sa.Dialect) -> sa.TextClause:
    """Postgres: stamp ``published_at_ms`` on the rows ``:ids`` (one array parameter), add the number
    stamped to the relay's ``published`` counter and read the next due time, in ONE statement (a
    data-modifying CTE); returns ``(stamped, next_due)``. Rows another relay stamped first are not
    stamped or counted again.

    ``next_due`` is what ``next_due`` would answer once the batch is marked: the earliest
    ``next_attempt_at_ms`` of the pending rows but ``:ids`` (the statement's snapshot still shows them
    pending; rows this transaction re-scheduled before it, failed or held, show their new time), NULL
    when none. The standalone relay sleeps until then without a query of its own per wake-up
    (relay/loop.py).

    The count goes to a stripe of the counter no other transaction holds (``counters.striped_increment_ctes``):
    a relay frozen between its mark and its COMMIT must not hold every other relay's mark.

    Parameters: ``now`` (ms), ``ids`` (list of seq), ``scope``, ``name`` and ``stripe`` (the counter's key
    and ``counters.stripe_prefix(name)``).
    """
    quote = dialect.identifier_preparer.format_table
    outbox, table = quote(tables.table(tables.outbox)), quote(tables.table(tables.counters))
    return sa.text(
        f"WITH marked AS (UPDATE {outbox} SET published_at_ms = :now "
        f"WHERE seq = ANY(:ids) AND published_at_ms IS NULL RETURNING 1), "
        f"m AS (SELECT count(*) AS n FROM marked), "
        f"{counters.striped_increment_ctes(table, amount='(SELECT n FROM m)')} "
        f"SELECT (SELECT n FROM m), (SELECT min(next_attempt_at_ms) FROM {outbox} "
        f"WHERE {PENDING_SQL} AND seq <> ALL(:ids))"
    ).bindparams(sa.bindparam("ids", type_=ARRAY(sa.BigInteger)))


# The SQL types of ``claim_mark_pg``'s parameters, for its prepared form.
CLAIM_MARK_TYPES = {"now_ms": "bigint", "claim_limit": "integer", "scope": "text", "name": "text", "stripe": "text"}


def claim_mark_pg(tables: Tables, dialect: sa.Dialect) -> sa.TextClause:
    """Postgres: claim up to ``:claim_limit`` due rows (``due_pending``'s rows, order, index and ``SKIP LOCKED``),
    stamp them published at ``:now_ms``, add them to the relay's ``published`` counter and read the next due
    time, in ONE statement (data-modifying CTEs), in the transaction that commits only after the broker
    confirmed them (relay/dispatch.py ``claim_batch``: nothing commits before the confirm, so a crash or a
    failed publish rolls the stamp back and the rows stay pending).

    Rows: ``(next_due, stripe, <CLAIM_COLUMNS>)`` in claim order, one row of NULL columns after ``stripe``
    when nothing was due. ``next_due``: the earliest ``next_attempt_at_ms`` of the pending rows but the
    claimed ones (NULL when none), what ``next_due`` answers once the batch commits with every row published;
    ``stripe``: the counter row the count went to (``counters.striped_increment_ctes``), which
    ``unstamp_pg`` takes back from. Parameters: ``now_ms``, ``claim_limit``, ``scope``, ``name``, ``stripe``
    (``counters.stripe_prefix(name)``).
    """
    quote = dialect.identifier_preparer.format_table
    outbox, table = quote(tables.table(tables.outbox)), quote(tables.table(tables.counters))
    cols = ", ".join(f"o.{name}" for name in CLAIM_COLUMNS)
    out = ", ".join(f"marked.{name}" for name in CLAIM_COLUMNS)
    return sa.text(
        f"WITH c AS (SELECT seq FROM {outbox} WHERE {PENDING_SQL} AND next_attempt_at_ms <= :now_ms "
        f"ORDER BY next_attempt_at_ms, seq LIMIT :claim_limit FOR UPDATE SKIP LOCKED), "
        f"marked AS (UPDATE {outbox} AS o SET published_at_ms = :now_ms FROM c WHERE o.seq = c.seq "
        f"RETURNING {cols}, o.next_attempt_at_ms AS due_at), "
        f"m AS (SELECT count(*) AS n FROM marked), "
        f"{counters.striped_increment_ctes(table, amount='(SELECT n FROM m)')}, "
        f"head AS (SELECT (SELECT min(next_attempt_at_ms) FROM {outbox} "
        f"WHERE {PENDING_SQL} AND seq <> ALL(ARRAY(SELECT seq FROM c))) AS next_due, "
        f"(SELECT name FROM bumped UNION ALL SELECT name FROM added LIMIT 1) AS stripe) "
        f"SELECT head.next_due, head.stripe, {out} FROM head LEFT JOIN marked ON true "
        f"ORDER BY marked.due_at, marked.seq"
    ).bindparams(sa.bindparam("now_ms", type_=sa.BigInteger), sa.bindparam("claim_limit", type_=sa.Integer))


def unstamp_pg(tables: Tables, dialect: sa.Dialect) -> sa.TextClause:
    """Postgres, after ``claim_mark_pg``: give the rows ``:ids`` their stamp ``:stamped`` back (pending again:
    the broker rejected them, they are held or can never be published; the caller then charges, holds or
    dead-letters them as ``dispatch.mark_rows`` does), stamp the rows ``:keep`` at ``:done`` instead (a batch
    whose confirm came late: relay/dispatch.py ``STAMP_SLACK_MS``), and take the rows given back off the
    counter row ``:stripe`` (scope ``:scope``) this transaction added them to. Returns how many were given back.
    """
    quote = dialect.identifier_preparer.format_table
    outbox, table = quote(tables.table(tables.outbox)), quote(tables.table(tables.counters))
    return sa.text(
        f"WITH fixed AS (UPDATE {outbox} SET published_at_ms = CASE WHEN seq = ANY(:keep) THEN "
        f"CAST(:done AS bigint) END WHERE (seq = ANY(:ids) OR seq = ANY(:keep)) AND published_at_ms = :stamped "
        f"RETURNING published_at_ms), "
        f"back AS (SELECT count(*) AS n FROM fixed WHERE published_at_ms IS NULL), "
        f"taken AS (UPDATE {table} SET value = value - (SELECT n FROM back) "
        f"WHERE consumer = :scope AND name = :stripe AND (SELECT n FROM back) > 0 RETURNING 1) "
        f"SELECT n, (SELECT count(*) FROM taken) FROM back"
    ).bindparams(sa.bindparam("ids", type_=ARRAY(sa.BigInteger)), sa.bindparam("keep", type_=ARRAY(sa.BigInteger)))
