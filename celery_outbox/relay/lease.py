"""Database leases for the periodic jobs: each runs once per interval, whoever runs it.

The reconciler and retention run wherever the relay runs: under beat (the ``celery_outbox.reconcile``
and ``celery_outbox.prune`` tasks) and in the standalone ``outbox relay`` loop. Several of those may run
at once (beat *and* a standalone relay, two standalone relays), so none of them decides alone: a job
runs only in the process that claims its lease.

A lease is one row of the counters table, ``(consumer='_relay', name='lease:<job>')``, whose value is
the instant (ms) the job is next due. Claiming it is one atomic statement, so two claimers can never
both win::

    INSERT INTO counters VALUES ('_relay', 'lease:<job>', now + interval)
        ON CONFLICT DO UPDATE SET value = max(value, now - early) + interval WHERE value <= now + early
        RETURNING value

(the very first claim inserts the row; a claimer that gets no row back lost, and reads the due instant).
The claim commits before the job runs, and nothing is ever released: a holder that crashes, hangs or
fails mid-job only loses its own pass, and the next interval is due as usual (no stale lock to expire).

The schedule stays anchored: a claim on time moves the due instant by exactly one interval, so the
job runs once per interval, not once per interval plus polling delay, and only a claimer later than
``early`` re-anchors on its own time (no burst of catch-up runs after an outage). A claimer that
polls (the standalone loop) uses ``early = 0``. ``early`` is for claimers driven by a timer of one
interval (beat): a beat task reaches the worker after a queueing delay that varies from tick to tick,
so it may arrive a little before or after the due instant; with ``timer_tolerance_ms`` (a tenth of
the interval) such ticks are never skipped, and two runs are never closer than ``interval - 2 x
early``. Instants come from the claimer's clock: hosts sharing a database should run NTP.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import counters
from celery_outbox.clock import Clock
from celery_outbox.db import wrap_driver_errors
from celery_outbox.schema import Tables
from celery_outbox.sql import insert_for

log = logging.getLogger("celery_outbox.relay.lease")

RECONCILE = "reconcile"
PRUNE = "prune"
SCOPE = counters.RELAY  # the relay's counters: never read as a consumer's by stats or metrics


def lease_name(job: str) -> str:
    """The counters row ``name`` of ``job``'s lease (fits the 64-character column)."""
    name = f"lease:{job}"
    if not job or len(name) > 64:
        raise ValueError(f"job name {job!r} must be 1-58 characters")
    return name


def timer_tolerance_ms(interval_ms: int) -> int:
    """How early a timer-driven claimer (beat) may claim: a tenth of the interval."""
    return max(0, interval_ms // 10)


@dataclass(frozen=True, kw_only=True)
class Claim:
    claimed: bool  # this caller runs the job now
    next_due_ms: int  # when the job is due next (after this claim, or as another claimer left it)


def claim(session: Session, job: str, *, interval_ms: int, clock: Clock, tables: Tables, early_ms: int = 0) -> Claim:
    """Claim ``job``'s lease if it is due (``<= now + early_ms``); commits either way."""
    if interval_ms <= 0:
        raise ValueError(f"interval_ms must be > 0, got {interval_ms}")
    c = tables.counters
    name = lease_name(job)
    now = clock.now_ms()
    with wrap_driver_errors(f"claiming the {job} lease"):
        # One statement: the first claim inserts the row, a later one moves it on only when it is due; either
        # way it returns the new due instant, and no row means another claimer holds the lease.
        stmt = insert_for(session, c).values(consumer=SCOPE, name=name, value=now + interval_ms)
        stmt = stmt.on_conflict_do_update(
            index_elements=["consumer", "name"], where=c.value <= now + early_ms,
            set_={"value": sa.case((c.value > now - early_ms, c.value), else_=now - early_ms) + interval_ms},
        ).returning(c.value)
        won = session.execute(stmt).scalar()
        due = won if won is not None else session.execute(
            sa.select(c.value).where(c.consumer == SCOPE, c.name == name)).scalar_one()
        session.commit()
    return Claim(claimed=won is not None, next_due_ms=int(due))


def next_due_ms(session: Session, job: str, *, tables: Tables) -> int | None:
    """When ``job`` is due next (None: never claimed)."""
    c = tables.counters
    value = session.execute(sa.select(c.value).where(c.consumer == SCOPE, c.name == lease_name(job))).scalar()
    return None if value is None else int(value)


class Lease:
    """One job's lease as a claimer sees it: asks the database only once the job may be due.

    ``due()`` is cheap between two due instants (the last ``next_due_ms`` it saw is a lower bound:
    the stored value only ever moves forward), so a loop polling every second costs one statement
    per interval, not one per poll.
    """

    def __init__(self, job: str, *, interval_ms: int, early_ms: int = 0) -> None:
        lease_name(job)
        if interval_ms <= 0:
            raise ValueError(f"interval_ms must be > 0, got {interval_ms}")
        self.job = job
        self.interval_ms = interval_ms
        self.early_ms = early_ms
        self._known_due_ms: int | None = None  # None: ask the database

    def claim(self, session_factory: sessionmaker[Session], clock: Clock, *, tables: Tables) -> bool:
        """True when this caller won the lease and must run the job now."""
        if self._known_due_ms is not None and clock.now_ms() + self.early_ms < self._known_due_ms:
            return False
        with session_factory() as session:
            result = claim(session, self.job, interval_ms=self.interval_ms, clock=clock, tables=tables,
                           early_ms=self.early_ms)
        self._known_due_ms = result.next_due_ms
        if not result.claimed:
            log.debug("%s not due (next at %s ms)", self.job, result.next_due_ms)
        return result.claimed


def timer_lease(job: str, *, interval_s: float) -> Lease:
    """The lease a claimer driven by a timer of one interval uses (beat's tasks): claims up to
    ``timer_tolerance_ms`` early, so a tick that arrives a little early is not skipped."""
    interval_ms = max(1, round(interval_s * 1000))
    return Lease(job, interval_ms=interval_ms, early_ms=timer_tolerance_ms(interval_ms))


def polling_lease(job: str, *, interval_s: float) -> Lease:
    """The lease a claimer that checks often (the standalone relay, after every drain) uses: claims
    at the due instant, which keeps the schedule exactly one interval apart."""
    return Lease(job, interval_ms=max(1, round(interval_s * 1000)))
