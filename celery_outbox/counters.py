"""Monotonic counters kept in the database (table ``outbox_counters``), for metrics and stats.

A counter is staged in the transaction that does the counted work (the relay's mark, a consumer's
dead letter, a retention batch), so it is exact across processes and restarts; Prometheus reads them
at scrape time (``celery_outbox.ops.metrics``). Hot paths stay free of them: a consumer's processed count is
derived (inbox rows + pruned inbox rows), not incremented per message.

On Postgres a counter is **striped**: an increment adds to any row of that counter no other transaction
holds (``FOR UPDATE SKIP LOCKED``), and when every one is held it starts a row of its own
(``name#<transaction id>``). So a process frozen (SIGSTOP, a VM pause) inside a transaction that counted
something never makes another process's increment, or the work it is committed with (a relay's mark),
wait for it: it holds only its own stripe (docs/scaling.md, "A relay frozen mid-transaction does not
hold the others"). There are at most as many stripes of a counter as transactions ever held it at once;
readers add them up (``value``, ``fold``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.orm import Session

from celery_outbox.db import is_postgres
from celery_outbox.schema import Tables
from celery_outbox.sql import upsert

log = logging.getLogger(__name__)

RELAY = "_relay"  # the scope of the relay's counters (a consumer name never starts with "_")
PUBLISHED = "published"
PUBLISH_FAILURES = "publish_failures"
BROKER_UNAVAILABLE = "broker_unavailable"
DEAD_LETTERED = "dead_lettered"
INBOX_PRUNED = "inbox_pruned"
DUPLICATES = "duplicates"  # per consumer: a delivery the inbox absorbed as one it had already taken
BATCHES = "batches"  # per batch consumer: batches committed (inbox/batch.py)
BATCHED_MESSAGES = "batched_messages"  # per batch consumer: messages in those batches (the mean size is the ratio)
# The reconciler's (relay/reconcile.py), in the RELAY scope: messages it sent again because they never arrived.
RECONCILED = "reconciled"  # every message sent again, all kinds
RECONCILED_EVENTS = "reconciled_events"  # (event, consumer) pairs
RECONCILED_TASKS = "reconciled_tasks"  # @outbox.task messages
RECONCILED_PLAIN_TASKS = "reconciled_plain_tasks"  # plain task messages
STRIPE = "#"  # name#<transaction id>: a stripe of counter ``name`` (module docstring)


def stripe_prefix(name: str) -> str:
    """The prefix of ``name``'s stripes (the ``:stripe`` parameter of ``striped_increment_ctes``)."""
    return name + STRIPE


def base_name(name: str) -> str:
    """The counter a row ``name`` adds to: ``published#123`` -> ``published``."""
    base, sep, tail = name.partition(STRIPE)
    return base if sep and tail.isdigit() else name


def striped_increment_ctes(table: str, *, amount: str, param: Callable[[str], str] = ":{}".format,
                           cte_prefix: str = "") -> str:
    """Postgres: the CTEs ``slot``, ``bumped`` and ``added`` of a WITH statement that adds ``amount`` (a SQL
    expression; nothing when it is not > 0) to counter ``(scope, name)``, stripes ``stripe``
    (``stripe_prefix``), without ever waiting for another transaction's row lock. ``table`` is quoted;
    ``param`` spells a bound parameter (SQLAlchemy's ``:name``; ``"%({})s".format`` for a DB-API cursor);
    ``cte_prefix`` names the CTEs apart, for several counters in one statement (``striped_increments``).
    Only ``name`` itself and ``name#<digits>`` are its rows, as ``base_name`` reads them. ``bumped`` and
    ``added`` return the ``name`` of the row the amount went to (the relay's claim reads it: relay/queries.py)."""
    scope, name, stripe = param("scope"), param("name"), f"CAST({param('stripe')} AS text)"
    slot, bumped, added = f"{cte_prefix}slot", f"{cte_prefix}bumped", f"{cte_prefix}added"
    return (
        f"{slot} AS (SELECT name FROM {table} WHERE consumer = {scope} "
        f"AND (name = {name} OR (left(name, length({stripe})) = {stripe} "
        f"AND substr(name, length({stripe}) + 1) ~ '^[0-9]+$')) AND {amount} > 0 "
        f"ORDER BY name LIMIT 1 FOR UPDATE SKIP LOCKED), "
        f"{bumped} AS (UPDATE {table} AS c SET value = c.value + {amount} FROM {slot} "
        f"WHERE c.consumer = {scope} AND c.name = {slot}.name RETURNING c.name), "
        f"{added} AS (INSERT INTO {table} (consumer, name, value) "
        f"SELECT {scope}, {stripe} || txid_current()::text, {amount} "
        f"WHERE {amount} > 0 AND NOT EXISTS (SELECT 1 FROM {bumped}) "
        f"ON CONFLICT (consumer, name) DO UPDATE SET value = {table}.value + EXCLUDED.value RETURNING name)"
    )


def striped_increments(table: str, count: int) -> str:
    """Postgres: ONE statement that adds ``:by<i>`` to counter ``(:scope, :name<i>)`` (stripes ``:stripe<i>``)
    for each ``i < count``, each as ``striped_increment_ctes`` does; ``increments_params`` binds it."""
    def numbered(i: int) -> Callable[[str], str]:
        return lambda p: ":scope" if p == "scope" else f":{p}{i}"

    ctes = [striped_increment_ctes(table, amount=f"CAST(:by{i} AS bigint)", param=numbered(i), cte_prefix=f"c{i}_")
            for i in range(count)]
    return f"WITH {', '.join(ctes)} SELECT 1"


def increments_params(scope: str, amounts: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """The parameters of ``striped_increments(table, len(amounts))``: counter ``(scope, name)`` += ``by``."""
    params: dict[str, Any] = {"scope": scope}
    for i, (name, by) in enumerate(amounts):
        params |= {f"name{i}": name, f"stripe{i}": stripe_prefix(name), f"by{i}": by}
    return params


def _increment_pg(session: Session, tables: Tables) -> sa.TextClause:
    table = session.get_bind().dialect.identifier_preparer.format_table(tables.table(tables.counters))
    return sa.text(f"WITH {striped_increment_ctes(table, amount='CAST(:by AS bigint)')} SELECT 1")


def stage_increment(session: Session, scope: str, name: str, by: int = 1, *, tables: Tables) -> None:
    """``counter(scope, name) += by`` inside the caller's transaction (the caller commits)."""
    if by <= 0:
        return
    if is_postgres(session):
        session.execute(_increment_pg(session, tables),
                        {"scope": scope, "name": name, "stripe": stripe_prefix(name), "by": by})
        return
    session.execute(upsert(session, tables.counters, {"consumer": scope, "name": name, "value": by},
                           keys=("consumer", "name"), update={"value": tables.counters.value + by}))


def increment(session: Session, scope: str, name: str, by: int = 1, *, tables: Tables) -> None:
    """``counter(scope, name) += by`` in a small transaction of its own, for work that has already
    committed (or rolled back). Observability only: a failure is logged, never raised."""
    try:
        stage_increment(session, scope, name, by, tables=tables)
        session.commit()
    except exc.DBAPIError as e:
        session.rollback()
        log.warning("could not count %s for %s: %s", name, scope, e.orig)


def fold(rows: Iterable[tuple[str, str, int]]) -> dict[str, dict[str, int]]:
    """``(scope, name, value)`` rows -> ``{scope: {counter: value}}``, the stripes of a counter added up."""
    out: dict[str, dict[str, int]] = {}
    for scope, name, value in rows:
        named = out.setdefault(scope, {})
        base = base_name(name)
        named[base] = named.get(base, 0) + int(value)
    return out


def value(session: Session, scope: str, name: str, *, tables: Tables) -> int:
    """Counter ``(scope, name)``: the sum of its stripes (0 when it was never incremented)."""
    c = tables.counters
    rows = session.execute(sa.select(c.name, c.value).where(c.consumer == scope))
    return fold((scope, n, v) for n, v in rows).get(scope, {}).get(name, 0)
