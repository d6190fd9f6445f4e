"""The standalone relay (``outbox relay``): drain until empty, then sleep until Postgres NOTIFY or the poll interval.

A committed outbox row fires the ``outbox_pending`` NOTIFY (the trigger of migration 0001), which wakes
the loop at once; polling is the fallback (SQLite, a lost LISTEN connection, rows whose backoff ends).
A wake-up does no more than a batch needs: it gathers commits for ``relay_gather_ms`` only while the
commit rate expects more (``adaptive.CommitRate``), drops the notifications its claim will see anyway,
builds its statements once (``queries.RelayStatements``), reads the next due time with the mark, and
reuses the worker registry for a second (``dispatch.RegistryCache``); docs/benchmarks.md has the figures.

What keeps it running: it catches every ``Exception`` and logs it (one bad row or a database blip must
not kill the relay: docs/design.md, rule 4). A database that goes silent can block a driver call where
no timeout reaches (``db.ConnectionTracker``), so a watchdog that sees no progress for ``stall_bound_s``
logs ``relay stalled`` and shuts the loop's database sockets down; the call fails and the loop goes on
with new connections. SIGTERM lets the current batch finish and be marked, within ``STOP_GRACE_S`` and
``STOP_GIVE_UP_S``. Every path keeps publish first, mark after: a failed mark leaves its rows pending.

A LISTEN behind a transaction pooler hears nothing, so each new LISTEN is proven by a probe NOTIFY before
it is trusted; else the relay says so in one warning line and polls (docs/deployment.md, "Behind
PgBouncer"). After every drain it runs the reconciler and hourly retention when their database lease is
due (``periodic_jobs``, relay/lease.py), once per interval wherever the relays run.

One module, though long: the loop, its watchdog and its stop path share the loop's connections and its
record of progress; apart, a stall or a stop could miss a connection the loop holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from celery_outbox.clock import Clock, SystemClock
from celery_outbox.db import ConnectionTracker, make_engine
from celery_outbox.ops.retention import PruneReport
from celery_outbox.ops.schedule import PRUNE_EVERY_MS, scheduled_prune
from celery_outbox.relay import lease
from celery_outbox.relay.adaptive import AdaptiveBatch, CommitRate
from celery_outbox.relay.breaker import CircuitBreaker
from celery_outbox.relay.dispatch import (
    STAMP_SLACK_MS,
    BatchResult,
    Claimed,
    CrashPointsLike,
    RegistryCache,
    RelayConfig,
    breaker_from_settings,
    claim_batch,
    dispatch,
    finish_batch,
    send_claimed,
)
from celery_outbox.relay.publisher import Publisher
from celery_outbox.relay.queries import RelayStatements, next_due
from celery_outbox.relay.queues import QueueInspector
from celery_outbox.relay.reconcile import ReconcileResult, reconcile
from celery_outbox.relay.single_flight import single_flight, sqlite_lock_path
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings

log = logging.getLogger("celery_outbox.relay.loop")

STALL_MARGIN_S = 2.0  # added to the longest healthy step (``stall_bound_s``)
STOP_GRACE_S = 0.4  # after SIGTERM: how long the current batch may finish before its connections are shut down
STOP_GIVE_UP_S = 0.7  # after SIGTERM: when ``run`` returns even if the loop's thread is still blocked
# A NOTIFY gathers (``relay_gather_ms``) only while the commit rate, decayed over this horizon, expects
# GATHER_MIN_COMMITS more commits within the window (relay/adaptive.py ``CommitRate``): a wake-up's claim,
# confirm wait, mark and COMMIT (and the broker's confirm) are then paid once for two commits or more instead
# of once per commit, which is most of the relay's cost per order at moderate rates. With the default 20 ms
# window the loop gathers from 50 commits/s, never at a trickle (20 orders/s: docs/benchmarks.md,
# "Gathering from 50 commits/s").
GATHER_RATE_HORIZON_S = 1.0
GATHER_MIN_COMMITS = 1
# A new LISTEN connection must hear a probe NOTIFY sent through the relay's sessions within this long, or
# the relay polls (a transaction pooler in between: see the module docstring), and LISTENs again this
# much later.
LISTEN_PROBE_TIMEOUT_S = 2.0
LISTEN_RETRY_S = 300.0


def stall_bound_s(settings: Settings, *, poll_interval_s: float | None = None) -> float:
    """How long the standalone loop may go without progress before its watchdog calls it stalled.

    The longest a healthy step takes between two signs of progress (a statement returned, a batch
    done, a wait over): a new connection (``db_connect_timeout_s``), one statement
    (``db_statement_timeout_ms``, which the server enforces), one publish with its connect, one
    reconnect and its confirms (3 x ``relay_publish_timeout_s``), one wait (the poll interval), and
    ``STALL_MARGIN_S``. With the defaults: 10 + 30 + 30 + 1 + 2 = 73 s.
    """
    poll = settings.relay_poll_interval_s if poll_interval_s is None else poll_interval_s
    return (settings.db_connect_timeout_s + settings.db_statement_timeout_ms / 1000
            + 3 * settings.relay_publish_timeout_s + poll + STALL_MARGIN_S)



@dataclass(kw_only=True)
class DrainResult:
    """Totals of one ``drain_once``."""

    batches: int = 0
    claimed: int = 0
    published: int = 0
    failed: int = 0
    dead_lettered: int = 0
    already_published: int = 0
    broker_unavailable: bool = False
    error: str | None = None
    dead_lettered_rows: list[tuple[str, str]] = field(default_factory=list)
    # The next due time the last mark read (Postgres, ``BatchResult.next_due_ms``); ``next_due_read``
    # False: unknown (the loop asks the database before it sleeps).
    next_due_ms: int | None = None
    next_due_read: bool = False

    def add(self, r: BatchResult) -> None:
        self.batches += 1
        if r.next_due_read:
            self.next_due_ms, self.next_due_read = r.next_due_ms, True
        elif r.claimed:  # a batch that claimed rows and did not read it: what came before is stale
            self.next_due_ms, self.next_due_read = None, False
        self.dead_lettered_rows.extend(r.dead_lettered_rows)
        self.claimed += r.claimed
        self.published += r.published
        self.failed += r.failed
        self.dead_lettered += r.dead_lettered
        self.already_published += r.already_published
        if r.broker_unavailable:
            self.broker_unavailable = True
            self.error = r.error


@dataclass(kw_only=True)
class LoopStats:
    """Counters a test or an operator can read while the loop runs."""

    drains: int = 0
    published: int = 0
    errors: int = 0
    waits: int = 0
    notify_wakeups: int = 0
    poll_wakeups: int = 0
    kick_wakeups: int = 0
    gathers: int = 0  # NOTIFY wake-ups that waited ``relay_gather_ms`` for more commits before claiming
    coalesced: int = 0  # notifications read and dropped because the claim after them sees their rows
    due_reads: int = 0  # next-due queries before a sleep (not needed when the last mark or empty claim read it)
    broker_unavailable: int = 0
    skipped_busy: int = 0  # SQLite: another drain held the single-flight lock
    reconciles: int = 0  # reconcile passes run (``reconcile_if_due``)
    reconciled: int = 0  # messages those passes sent again ((event, consumer) pairs and tasks)
    prunes: int = 0  # retention passes run (``prune_if_due``)
    pruned: int = 0  # inbox and published outbox rows those passes deleted
    stalls: int = 0  # times the watchdog found no progress within ``stall_after_s``
    watchdog_wakeups: int = 0  # times the watchdog woke: at its next deadline, a stop, or the loop's end
    interrupted: int = 0  # database connections the watchdog or a stop shut down
    abandoned: bool = False  # ``run`` returned after SIGTERM with the loop's thread still blocked
    listening: bool = False  # a LISTEN connection whose probe NOTIFY arrived is open
    listen_unheard: int = 0  # LISTEN connections dropped because their probe NOTIFY never arrived


class _PgListener:
    """A dedicated autocommit connection (psycopg2 or psycopg 3) that LISTENs on ``outbox_pending``.

    Taken raw from the relay's engine, so it carries the engine's libpq parameters (``make_engine``):
    opening it gives up after the connect timeout, and a peer that vanished without closing is found
    by TCP keepalives (idle socket) or ``tcp_user_timeout`` (unacknowledged data), which makes
    ``consume`` raise; ``RelayLoop.run`` then drops it and LISTENs again. Waiting on it never blocks
    past the poll interval (``select`` with a timeout; ``consume`` only reads what has arrived), and
    polling goes on meanwhile, so a listener that hears nothing delays nothing.
    """

    def __init__(self, engine: Any, channel: str) -> None:
        proxy = engine.raw_connection()
        self.conn: Any = proxy.driver_connection
        proxy.detach()  # never hand a LISTENing connection back to the pool
        self._proxy = proxy
        self.conn.rollback()
        self.conn.autocommit = True
        with self.conn.cursor() as cur:
            cur.execute(f"LISTEN {channel}")

    def fileno(self) -> int:
        fd: int = self.conn.fileno()
        return fd

    def consume(self) -> int:
        """Read the notifications that have arrived, without waiting (psycopg2 or psycopg 3)."""
        return len(self._payloads())

    def _payloads(self) -> list[str]:
        if hasattr(self.conn, "poll"):  # psycopg2: poll() fills the notifies list
            self.conn.poll()
            payloads = [n.payload for n in self.conn.notifies]
            self.conn.notifies.clear()
            return payloads
        return [n.payload for n in self.conn.notifies(timeout=0)]  # psycopg 3.2+: a generator; 0 = what is here

    def hears(self, send: Callable[[str], None], *, timeout_s: float) -> bool:
        """Whether a NOTIFY that ``send(payload)`` commits on another connection reaches this one within
        ``timeout_s``. Notifications read meanwhile are dropped (the drain that follows takes their rows)."""
        payload = f"probe:{uuid.uuid4().hex}"
        send(payload)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if select.select([self], [], [], left)[0] and payload in self._payloads():
                return True
        return False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


class RelayLoop:
    """Drains with ``dispatch_batch`` and waits for NOTIFY/poll; see the module docstring."""

    def __init__(self, *, settings: Settings, tables: Tables, session_factory: sessionmaker[Session], publisher: Publisher,
                 clock: Clock | None = None, breaker: CircuitBreaker | None = None,
                 crash_points: CrashPointsLike | None = None, batch_size: int | None = None,
                 poll_interval_s: float | None = None, listen: bool = True,
                 max_batches_per_drain: int = 10_000,
                 routes: Mapping[str, Sequence[str]] | None = None,
                 on_drain: Callable[[DrainResult], None] | None = None, pipelined: bool = True,
                 idempotent_tasks: Collection[str] = (),
                 on_reconcile: Callable[[ReconcileResult], None] | None = None,
                 queues: QueueInspector | None = None) -> None:
        self.settings = settings
        self.tables = tables
        self.routes = settings.routes if routes is None else routes
        # The @outbox.task names (Outbox.idempotent_tasks), passed like routes: the reconciler checks their inbox.
        self.idempotent_tasks = frozenset(idempotent_tasks)
        self.on_reconcile = on_reconcile  # like on_drain, with every reconcile pass that sent something
        # The reconciler's broker evidence (relay/queues.py); None: the publisher's, if it answers.
        self.queues = queues
        self.session_factory = session_factory
        self.publisher = publisher
        self.clock = clock or SystemClock()
        self.breaker = breaker or breaker_from_settings(settings)
        self.crash_points = crash_points
        # An explicit ``batch_size`` is a fixed size; from the settings the size adapts (relay/adaptive.py)
        # between relay_batch_size and relay_max_in_flight_rows.
        self.batch_size = batch_size or settings.relay_batch_size
        self.sizer = AdaptiveBatch(minimum=self.batch_size,
                                   maximum=batch_size or max(self.batch_size, settings.relay_max_in_flight_rows))
        bind = session_factory.kw.get("bind")
        # Postgres: batches overlap (``_drain_pipelined``); SQLite's one write lock keeps them in sequence.
        self.pipelined = pipelined and bind is not None and bind.dialect.name == "postgresql"
        self._lock_path = sqlite_lock_path(bind.url.render_as_string(hide_password=False) if bind is not None else "")
        self.poll_interval_s = poll_interval_s or settings.relay_poll_interval_s
        self.listen = listen
        # After a NOTIFY, while GATHER_MIN_COMMITS more are expected within the window, wait the window for
        # them, so one claim, publish and mark serve several (``_gather``); the rate counts every notification.
        self.gather_s = settings.relay_gather_ms / 1000
        self.commit_rate = CommitRate(horizon_s=GATHER_RATE_HORIZON_S)
        self._due_hint: DrainResult | None = None  # the last drain, when its mark read the next due time
        self.max_batches_per_drain = max_batches_per_drain
        # Read once, not per claim, with the claim and the mark built once (relay/queries.py ``RelayStatements``);
        # the worker registry is reused for a second between wake-ups (RegistryCache).
        self.config = RelayConfig.from_settings(
            settings, tables=tables, routes=self.routes,
            statements=RelayStatements.build(tables, bind.dialect) if bind is not None else None)
        self._registry_cache = RegistryCache.for_hold(self.config.hold) if self.config.hold is not None else None
        # Called with every finished drain (e.g. the CLI sends Celery events for its dead letters);
        # it must not raise, and if it does the error is logged: the drain is done either way.
        self.on_drain = on_drain
        self.stats = LoopStats()
        self._stop = threading.Event()
        # kick() wakes the loop's wait through the first pipe; a stop or the loop's end wakes the watchdog,
        # asleep until its next deadline (``_watch``), through the second (a signal handler can write to a pipe)
        self._wake_r, self._wake_w = os.pipe()
        self._watch_r, self._watch_w = os.pipe()
        for fd in (self._wake_r, self._wake_w, self._watch_r, self._watch_w):
            os.set_blocking(fd, False)
        self._listener: _PgListener | None = None
        self._listen_engine: Engine | None = None  # OUTBOX_RELAY_LISTEN_URL's, built at the first LISTEN
        self._listen_again_at = 0.0  # monotonic: after a probe that went unheard, no LISTEN before this
        # The watchdog's view (``run``): the last sign of progress, the instant a stop was asked for.
        self.stall_after_s = stall_bound_s(settings, poll_interval_s=self.poll_interval_s)
        self._engine: Engine | None = bind if isinstance(bind, Engine) else None
        self._tracker = ConnectionTracker(self._engine) if self._engine is not None else None
        self._progress_at = time.monotonic()
        self._stop_at: float | None = None
        self._served = threading.Event()
        self._beat = self._progress  # one bound method object: the same one is listened to and removed

    # -- control ---------------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Ask ``run`` to return after the current batch (safe from signal handlers and threads)."""
        if self._stop_at is None:
            self._stop_at = time.monotonic()
        self._stop.set()
        self.kick()
        self._wake_watchdog()

    def kick(self) -> None:
        """Wake a waiting loop now."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _wake_watchdog(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._watch_w, b"x")

    # -- work ------------------------------------------------------------------------------------
    def drain_once(self) -> DrainResult:
        """Publish due rows batch after batch until none is left or the broker is unreachable.

        On Postgres the batches are pipelined (``_drain_pipelined``); on SQLite (one write lock, one
        relay) they run one after another.
        """
        total = DrainResult()
        self._due_hint = None
        with single_flight(self._lock_path) as mine:
            if not mine:
                self.stats.skipped_busy += 1
                return total
            if self.pipelined:
                self._drain_pipelined(total)
            else:
                self._drain_sequential(total)
        if total.next_due_read:
            self._due_hint = total
        self.stats.drains += 1
        self.stats.published += total.published
        if total.broker_unavailable:
            self.stats.broker_unavailable += 1
        if self.on_drain is not None:
            try:
                self.on_drain(total)
            except Exception:
                log.exception("on_drain callback failed; the drain itself is done")
        return total

    def _drain_sequential(self, total: DrainResult) -> None:
        """Claim, publish, confirm, mark, commit; then the next batch (until an empty one)."""
        for _ in range(self.max_batches_per_drain):
            asked = self.sizer.size
            self._coalesce_notifies()
            with self.session_factory() as session:
                result = dispatch(session, self.publisher, self.clock, self.config, batch_size=asked,
                                  breaker=self.breaker, crash_points=self.crash_points)
            total.add(result)
            self._progress()
            if not result.breaker_open:
                self.sizer.observe(asked=asked, claimed=result.claimed)
            if result.broker_unavailable or result.claimed == 0 or self.stopping:
                break

    def _claim_next(self, *, first: bool = False) -> Claimed | BatchResult:
        """Claim and build the next batch on a session of its own (the caller closes it). The ``first`` claim of
        a drain reads the next due time in its transaction (no batch of ours is in flight then, so the pending
        rows it sees are what the loop sleeps for): the wait needs no query of its own. On Postgres it also
        stamps its rows published in that same statement (``dispatch.claim_batch``'s ``stamp``: committed only
        after the confirm); a claim made while a batch is in flight is marked after its own confirm, because
        it is sent only after that batch is done."""
        now = self.clock.now_ms()
        if not self.breaker.allow(now):
            return BatchResult(broker_unavailable=True, breaker_open=True, error=self.breaker.last_error)
        self._coalesce_notifies()
        session = self.session_factory()
        try:
            return claim_batch(session, self.clock, self.config, limit=self.breaker.batch_limit(now, self.sizer.size),
                               registry_cache=self._registry_cache, read_next_due=first, stamp=first)
        except BaseException:
            session.close()
            raise

    def _drain_pipelined(self, total: DrainResult) -> None:
        """Overlap batch N+1's database work with batch N's broker round trip (Postgres only).

        For each batch N: put N on the wire; while the broker confirms it, claim and build N+1 on
        its own session (``FOR UPDATE SKIP LOCKED`` passes over N's rows, which N's open transaction
        still locks); then wait for N's confirms, mark N and commit; then send N+1. Publish first,
        mark after holds for every row, and only ONE batch is ever published and unmarked, so a
        crash re-publishes at most ``relay_max_in_flight_rows`` rows (the inbox absorbs them); N+1
        was not published yet, its claim dies with its connection. The next batch is claimed after a
        full one, or when commits were notified while N was claimed and sent (smart batching: N+1 takes
        what arrived while N was in flight, and the loop does not go back to its wait for it, for up to a
        poll interval, so the reconciler and retention still get their turn); a short batch with nothing
        notified since means the outbox is drained for now. Nothing ever waits for commits that are not there.
        """
        crash_points = self.crash_points
        # notified commits keep the drain going for at most a poll interval: the periodic jobs run between drains
        follow_until = time.monotonic() + self.poll_interval_s
        nxt = self._claim_next(first=True)
        try:
            batches = 0
            while True:
                if isinstance(nxt, BatchResult):  # the breaker refused: nothing was claimed
                    total.add(nxt)
                    return
                claimed = nxt
                if not claimed.rows:
                    total.add(claimed.result)
                    return
                flight = send_claimed(claimed, self.publisher, self.clock, self.config, breaker=self.breaker,
                                      crash_points=crash_points)
                if isinstance(flight, BatchResult):  # the broker is away: every row left pending
                    total.add(flight)
                    return
                batches += 1
                self.sizer.observe(asked=claimed.limit, claimed=len(claimed.rows))
                more = not self.stopping and batches < self.max_batches_per_drain and (
                    len(claimed.rows) >= claimed.limit
                    or (time.monotonic() < follow_until and self._coalesce_notifies() > 0))
                nxt = self._claim_next() if more else BatchResult()
                if crash_points is not None and isinstance(nxt, Claimed) and nxt.rows:
                    crash_points.reached("relay_in_flight_next_claimed")
                try:
                    result = finish_batch(flight, self.clock, self.config, breaker=self.breaker,
                                          crash_points=crash_points)
                finally:
                    claimed.session.close()
                total.add(result)
                self._progress()
                if result.broker_unavailable or not more:
                    return
        finally:
            if isinstance(nxt, Claimed):  # claimed but never sent: give the rows back
                with contextlib.suppress(Exception):
                    nxt.session.rollback()
                nxt.session.close()

    def run(self, *, handle_signals: bool = True) -> None:
        """Loop until ``stop()`` or SIGTERM; exceptions are logged and the loop goes on.

        From the main thread with ``handle_signals`` the loop runs in a thread of its own and the main
        thread handles SIGTERM and watches it; elsewhere the loop runs in the calling thread and a
        watchdog thread watches it (see the module docstring).
        """
        supervised = handle_signals and threading.current_thread() is threading.main_thread()
        previous: Any = signal.signal(signal.SIGTERM, self._on_sigterm) if supervised else None
        log.info("relay loop started (batch %s, poll %.3gs, listen %s, stall bound %.3gs)", self.batch_size,
                 self.poll_interval_s, self._listen_plan(), self.stall_after_s)
        self._attach()
        self._served.clear()
        try:
            if supervised:
                self._run_in_thread()
            else:
                watchdog = threading.Thread(target=self._watch, args=(None,), name="outbox-relay-watchdog",
                                            daemon=True)
                watchdog.start()
                try:
                    self._serve()
                finally:
                    self._served.set()
                    self._wake_watchdog()
                    watchdog.join()
        finally:
            if not self.stats.abandoned:  # an abandoned thread may still hold the listener
                self._close_listener()
            self._detach()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            log.info("relay loop stopped")

    def _serve(self) -> None:
        """The loop itself: drain, periodic jobs, wait; until stopped."""
        while not self.stopping:
            self._progress()
            self._ensure_listener()
            try:
                self.drain_once()
            except Exception:
                self.stats.errors += 1
                log.exception("relay batch failed; retrying after the poll interval")
            self._progress()
            if self.stopping:
                break
            self.periodic_jobs()
            self._progress()
            try:
                self._wait()
            except Exception:
                self.stats.errors += 1
                log.exception("waiting for outbox notifications failed; falling back to polling")
                self._close_listener()

    def _run_in_thread(self) -> None:
        """``_serve`` in a daemon thread, watched from this (the main) thread, which takes the signals."""
        failure: list[BaseException] = []

        def body() -> None:
            try:
                self._serve()
            except BaseException as e:  # handed to the main thread below
                failure.append(e)
            finally:
                self._served.set()
                self._wake_watchdog()

        worker = threading.Thread(target=body, name="outbox-relay", daemon=True)
        worker.start()
        try:
            self._watch(worker)
        except KeyboardInterrupt:
            self.stop()
            self._watch(worker)
            raise
        if failure:
            raise failure[0]

    def _watch(self, worker: threading.Thread | None) -> None:
        """The watchdog: shut the database connections down when the loop makes no progress for
        ``stall_after_s``, or when a stop was asked for ``STOP_GRACE_S`` ago and it is still busy;
        with ``worker`` (main-thread mode), give up waiting for it ``STOP_GIVE_UP_S`` after a stop. It sleeps
        until its next deadline (progress meanwhile moves it: it then sleeps again); a stop or the loop's end
        wakes it at once."""

        def alive() -> bool:  # ``_served`` is set as the loop ends, before its thread does
            return not self._served.is_set() and (worker is None or worker.is_alive())

        acted_at = 0.0
        stop_acted = False
        while alive():
            stop_at = self._stop_at
            if stop_at is None:
                due = max(self._progress_at, acted_at) + self.stall_after_s
            elif not stop_acted:
                due = stop_at + STOP_GRACE_S
            else:  # without ``worker`` nothing is left to do but wait for the loop's end
                due = stop_at + STOP_GIVE_UP_S if worker is not None else time.monotonic() + self.stall_after_s
            self._doze(until=due)
            if not alive():
                return
            now = time.monotonic()
            stop_at = self._stop_at
            if stop_at is not None:
                if now - stop_at >= STOP_GRACE_S and not stop_acted:
                    stop_acted = True
                    closed = self._interrupt()
                    if closed:
                        log.warning("stopping: the loop is still busy %.1fs after the stop; shut down its %d "
                                    "database connection(s) (rows not marked stay pending)", STOP_GRACE_S, closed)
                if worker is not None and now - stop_at >= STOP_GIVE_UP_S:
                    self.stats.abandoned = True
                    log.warning("stopping without the loop's thread, still blocked %.1fs after the stop: rows it "
                                "published and did not mark are published again later, never lost", now - stop_at)
                    return
                continue
            quiet = now - max(self._progress_at, acted_at)
            if quiet >= self.stall_after_s:
                acted_at = now
                self.stats.stalls += 1
                closed = self._interrupt()
                log.error("relay stalled: no progress for %.1fs (bound %.1fs, from the database and publish "
                          "timeouts); shut down %d database connection(s) so the loop starts again on new ones",
                          quiet, self.stall_after_s, closed)

    def _doze(self, *, until: float) -> None:
        """The watchdog's sleep: until ``until`` (monotonic), or a write to its pipe (a stop, the loop's end)."""
        self.stats.watchdog_wakeups += 1
        left = until - time.monotonic()
        if left > 0 and select.select([self._watch_r], [], [], left)[0]:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._watch_r, 512):
                    pass

    def _progress(self, *_: Any) -> None:
        """A sign of progress for the watchdog (also a listener of every statement that returns)."""
        self._progress_at = time.monotonic()

    def _interrupt(self) -> int:
        """Shut down the sockets of the loop's database connections (from the watchdog's thread)."""
        closed = self._tracker.shutdown_all() if self._tracker is not None else 0
        self.stats.interrupted += closed
        return closed

    def _attach(self) -> None:
        self._progress_at = time.monotonic()
        if self._engine is not None:
            event.listen(self._engine, "after_cursor_execute", self._beat)
        if self._tracker is not None:
            self._tracker.attach()

    def _detach(self) -> None:
        if self._engine is not None and event.contains(self._engine, "after_cursor_execute", self._beat):
            event.remove(self._engine, "after_cursor_execute", self._beat)
        if self._tracker is not None:
            self._tracker.detach()

    # -- periodic jobs: reconcile and retention, under database leases ---------------------------
    _leases: dict[str, lease.Lease] | None = None

    def _lease(self, job: str, interval_ms: int) -> lease.Lease:
        if self._leases is None:
            self._leases = {}
        found = self._leases.get(job)
        if found is None:
            found = self._leases[job] = lease.Lease(job, interval_ms=max(1, interval_ms))
        return found

    def _claim(self, job: str, interval_ms: int) -> bool:
        """Claim ``job``'s lease (relay/lease.py); a database that cannot answer is logged, not raised."""
        try:
            return self._lease(job, interval_ms).claim(self.session_factory, self.clock, tables=self.tables)
        except Exception as e:
            self.stats.errors += 1
            log.warning("could not claim the %s lease (retrying at the next poll): %s", job, e)
            return False

    def periodic_jobs(self) -> None:
        """The reconciler and retention, each when its lease is due (checked after every drain)."""
        self.reconcile_if_due()
        if not self.stopping:
            self.prune_if_due()

    @property
    def publish_skew_ms(self) -> int:
        """The longest a published row can be marked after a later one was sent: the publish timeout, plus
        how long before its send a row stamped at its claim can be marked (``dispatch.STAMP_SLACK_MS``)."""
        return round(self.settings.relay_publish_timeout_s * 1000) + STAMP_SLACK_MS

    def reconcile_if_due(self) -> ReconcileResult | None:
        """One reconcile pass (relay/reconcile.py) when this process wins the ``reconcile`` lease.

        The lease (relay/lease.py) is shared with beat's ``celery_outbox.reconcile`` task and every
        other standalone relay on the database, so one pass runs per ``relay_reconcile_interval_s``
        however many of them run; the first claim on a fresh database runs at once. Checked after
        every drain, so at most one poll interval late. The lease is spent before the pass starts:
        a failing pass is logged (never raised) and the next one runs an interval later, and it loses
        nothing, because the watermark only moves once the pass has published. Returns None when not
        due, claimed elsewhere, or when the pass failed.
        """
        if not self._claim(lease.RECONCILE, round(self.settings.relay_reconcile_interval_s * 1000)):
            return None
        try:
            with self.session_factory() as session:
                result = reconcile(session, self.publisher, self.clock, tables=self.tables, routes=self.routes,
                                   namespace=self.settings.namespace, max_message_bytes=self.settings.max_message_bytes,
                                   older_than_ms=self.settings.relay_reconcile_after_ms,
                                   idempotent_tasks=self.idempotent_tasks,
                                   plain_older_than_ms=self.settings.relay_reconcile_plain_tasks_after_ms,
                                   queues=self.queues, publish_skew_ms=self.publish_skew_ms)
        except Exception:
            self.stats.errors += 1
            log.exception("reconcile pass failed; retrying after the reconcile interval")
            return None
        self.stats.reconciles += 1
        self.stats.reconciled += result.republished
        if self.on_reconcile is not None and result.resent:
            try:
                self.on_reconcile(result)
            except Exception:
                log.exception("on_reconcile callback failed; the pass itself is done")
        return result

    def prune_if_due(self) -> PruneReport | None:
        """Retention (ops/schedule.py: the same defaults as beat's hourly ``celery_outbox.prune``) when
        this process wins the ``prune`` lease, shared with that task: one pass per hour in all.

        A failing pass is logged, never raised, and retried an hour later (every batch it committed
        stays deleted; the rest waits for the next pass). Returns None when not due or failed.
        """
        if not self._claim(lease.PRUNE, PRUNE_EVERY_MS):
            return None
        try:
            report = scheduled_prune(self.session_factory, settings=self.settings, tables=self.tables, clock=self.clock)
        except Exception:
            self.stats.errors += 1
            log.exception("retention pass failed; retrying after the prune interval")
            return None
        self.stats.prunes += 1
        self.stats.pruned += report.inbox_deleted + report.outbox_deleted
        return report

    def close(self) -> None:
        self._detach()
        self._close_listener()
        if self._listen_engine is not None:
            self._listen_engine.dispose()
            self._listen_engine = None
        for fd in (self._wake_r, self._wake_w, self._watch_r, self._watch_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def until_next_due_s(self) -> float:
        """Seconds until the earliest pending row is due (a held task, a backoff), at least 10 ms, so the wait
        ends when it is due even with no NOTIFY (nothing is inserted then); the poll interval when none is
        pending or the database cannot say (docs/scheduled.md)."""
        try:
            with self.session_factory() as session:
                due = session.execute(next_due(self.tables)).scalar()
        except Exception as e:
            log.warning("could not read the next due time (waiting the poll interval): %s", e)
            return self.poll_interval_s
        return self.poll_interval_s if due is None else max(0.01, (int(due) - self.clock.now_ms()) / 1000)

    # -- internals -------------------------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        log.info("SIGTERM: finishing the current batch (at most %.1fs), then stopping", STOP_GIVE_UP_S)
        self.stop()

    def _listen_source(self) -> str:
        return "OUTBOX_RELAY_LISTEN_URL" if self.settings.relay_listen_url else "the database URL"

    def _listen_plan(self) -> str:
        """How the loop means to be woken, for its start line: only a probe proves a LISTEN works."""
        engine = self.session_factory.kw.get("bind")
        if not self.listen:
            return "off"
        if engine is None or engine.dialect.name != "postgresql":
            return "off (not Postgres)"
        return f"to be proven by a probe NOTIFY, through {self._listen_source()}"

    def _send_probe(self, payload: str) -> None:
        with self.session_factory() as session:
            session.execute(sa.select(sa.func.pg_notify(self.tables.notify_channel, payload)))
            session.commit()

    def _ensure_listener(self) -> None:
        if not self.listen or self._listener is not None or time.monotonic() < self._listen_again_at:
            return
        engine = self.session_factory.kw.get("bind")
        if engine is None or engine.dialect.name != "postgresql":
            return
        channel, source = self.tables.notify_channel, self._listen_source()
        try:
            if self.settings.relay_listen_url and self._listen_engine is None:
                self._listen_engine = make_engine(self.settings.relay_listen_url, settings=self.settings,
                                                  poolclass=NullPool)
            listener = _PgListener(self._listen_engine or engine, channel)
        except Exception:
            log.exception("LISTEN %s through %s failed; polling only until it works", channel, source)
            return
        try:
            heard = listener.hears(self._send_probe, timeout_s=LISTEN_PROBE_TIMEOUT_S)
        except Exception as e:
            listener.close()
            log.warning("LISTEN %s through %s: the probe NOTIFY failed (%s); polling until LISTEN works", channel,
                        source, e)
            return
        if not heard:
            listener.close()
            self.stats.listen_unheard += 1
            self._listen_again_at = time.monotonic() + LISTEN_RETRY_S
            log.warning("LISTEN %s through %s heard no NOTIFY within %.3gs (a transaction pooler such as PgBouncer "
                        "between the relay and Postgres?): polling every %.3gs, LISTEN again in %.0fs; give "
                        "OUTBOX_RELAY_LISTEN_URL a direct connection (docs/deployment.md, 'Behind PgBouncer')",
                        channel, source, LISTEN_PROBE_TIMEOUT_S, self.poll_interval_s, LISTEN_RETRY_S)
            return
        self._listener = listener
        self.stats.listening = True
        log.info("listening on %s through %s: a probe NOTIFY arrived", channel, source)

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            self.stats.listening = False

    def _until_due_s(self) -> float:
        """``until_next_due_s``, from the last drain's mark or empty first claim when it read the next due
        time (Postgres, relay/queries.py), else from one query."""
        hint, self._due_hint = self._due_hint, None
        if hint is None:
            self.stats.due_reads += 1
            return self.until_next_due_s()
        due = hint.next_due_ms
        return self.poll_interval_s if due is None else max(0.01, (due - self.clock.now_ms()) / 1000)

    def _coalesce_notifies(self) -> int:
        """Read and drop the notifications that have arrived, just before a claim: their commits are
        visible to it (Postgres delivers a NOTIFY after its transaction committed), so the claim takes
        their rows, and they must not wake the loop again for nothing after this drain. A notification
        that arrives later wakes it as usual. Returns how many were read."""
        if self._listener is None:
            return 0
        try:
            n = self._listener.consume()
        except Exception as e:  # the LISTEN connection is broken: poll until it is back (``_ensure_listener``)
            log.warning("reading outbox notifications failed; polling until LISTEN works again: %s", e)
            self._close_listener()
            return 0
        self.stats.coalesced += n
        if n:
            self.commit_rate.add(n, at=time.monotonic())
        return n

    def _consume_wakeup(self) -> int:
        """The notifications that woke the wait: read, dropped and counted into the commit rate."""
        assert self._listener is not None
        n = self._listener.consume()
        if n:
            self.commit_rate.add(n, at=time.monotonic())
        return n

    def _gather(self) -> None:
        """After a NOTIFY: wait ``relay_gather_ms`` for more commits before the drain claims (one claim,
        publish, confirm wait and mark for all of them), while the commit rate expects
        ``GATHER_MIN_COMMITS`` within the window (``adaptive.CommitRate``). A stop or a kick ends the wait
        at once; the notifications it collected are dropped by the claim (``_coalesce_notifies``)."""
        if (self.gather_s <= 0 or self.stopping
                or not self.commit_rate.expects_more(self.gather_s, at=time.monotonic(),
                                                     commits=GATHER_MIN_COMMITS)):
            return
        self.stats.gathers += 1
        if select.select([self._wake_r], [], [], self.gather_s)[0]:
            self._take_kicks()  # the kick that ended it: the next wait must not end for it again

    def _take_kicks(self) -> None:
        """Empty the kick pipe: one kick (or several at once) wakes one wait or ends one gather."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 512):
                pass
        self.stats.kick_wakeups += 1

    def _wait(self) -> None:
        breaker_wait = self.breaker.wait_ms(self.clock.now_ms()) / 1000
        # an open breaker publishes nothing, due or not; otherwise wake when the next held row is due
        timeout = min(self.poll_interval_s, breaker_wait if breaker_wait > 0 else self._until_due_s())
        fds: list[Any] = [self._wake_r]
        if self._listener is not None:
            fds.append(self._listener)
        self.stats.waits += 1
        ready, _, _ = select.select(fds, [], [], timeout)
        if not ready:
            self.stats.poll_wakeups += 1
            return
        kicked = self._wake_r in ready
        if kicked:
            self._take_kicks()
        if self._listener is not None and self._listener in ready and self._consume_wakeup():
            self.stats.notify_wakeups += 1
            if not kicked:  # a kick asks for a claim now (``_gather``)
                self._gather()
