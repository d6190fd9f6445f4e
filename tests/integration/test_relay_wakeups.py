"""What the standalone relay does per wake-up on Postgres (issue #24): the mark reads the next due time,
a claim swallows the notifications of the rows it takes, a NOTIFY gathers more commits while they come
faster than one per window,
and the worker registry is reused between wake-ups only when it holds nothing."""

from __future__ import annotations

import select
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables, workers
from celery_outbox.clock import ManualClock
from celery_outbox.messages import TASK_KIND
from celery_outbox.relay.dispatch import ClaimedRow, RegistryCache, RelayConfig, claim_due, held_rows, mark_rows
from celery_outbox.relay.loop import GATHER_MIN_COMMITS, RelayLoop
from celery_outbox.relay.queries import claim_mark_pg, next_due
from celery_outbox.schema import PENDING_SQL
from celery_outbox.testing.memory import InMemoryPublisher
from celeryconfig import Settings
from tests.outbox_rows import insert_pending

pytestmark = pytest.mark.postgres


def settings(tmp_path: Path, pg_url: str, **kw: object) -> Settings:
    values: dict[str, object] = {"relay_poll_interval_s": 0.05, **kw}
    return Settings(home=tmp_path, database_url=pg_url, namespace="wk", routes={"OrderPlaced": ("shipping",)},
                    **values)  # type: ignore[arg-type]


def schedule(sessions: sessionmaker[Session], tables: Tables, due_ms: int) -> None:
    """One pending row due at ``due_ms`` (a held task, a backoff)."""
    with sessions() as s:
        s.add(tables.outbox(message_id=uuid.uuid4(), type="OrderPlaced", payload={}, headers={},
                            created_at_ms=due_ms, next_attempt_at_ms=due_ms, attempts=0))
        s.commit()


def test_the_mark_reads_the_earliest_due_time_of_the_other_pending_rows(
        pg_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    # Given two due rows and one due in 5 s
    now = clock.now_ms()
    insert_pending(pg_sessions, now, 2, tables=tables)
    schedule(pg_sessions, tables, now + 5_000)
    with pg_sessions() as s:
        a, b = claim_due(s, now, 2, tables=tables)
        # When the batch is marked: a published, b rejected (backoff 1 s)
        config = RelayConfig(tables=tables, routes={}, max_message_bytes=10_000, max_attempts=5, base_delay_ms=1_000,
                             max_delay_ms=60_000)
        m = mark_rows(s, now, config, published=[a], failed={1: (b, "nack")}, count=True)
        s.commit()
    # Then the mark read the next due time: b's backoff (the update before it is seen; a is not counted),
    # the same as the query the loop used to send before it slept
    assert (m.marked, m.failed, m.next_due_read, m.next_due_ms) == (1, 1, True, now + 1_000)
    with pg_sessions() as s:
        assert s.execute(next_due(tables)).scalar() == now + 1_000


def test_a_drain_sleeps_until_the_due_time_its_mark_or_its_empty_claim_read_without_a_query_of_its_own(
        pg_sessions: sessionmaker[Session], pg_url: str, tmp_path: Path, clock: ManualClock, tables: Tables) -> None:
    # Given a due row and one held for 3 s
    insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables)
    schedule(pg_sessions, tables, clock.now_ms() + 3_000)
    loop = RelayLoop(settings=settings(tmp_path, pg_url), tables=tables, session_factory=pg_sessions,
                     publisher=InMemoryPublisher(), clock=clock, listen=False)
    # When the loop drains, Then it would sleep 3 s, without a query of its own
    assert loop.drain_once().published == 1
    assert (loop._until_due_s(), loop.stats.due_reads) == (3.0, 0)
    # When a drain claims nothing (no mark), Then its claim read the due time: the same answer, no query
    assert loop.drain_once().claimed == 0
    assert (loop._until_due_s(), loop.stats.due_reads) == (3.0, 0)
    # And with nothing pending at all, the empty claim says so: the wait is the poll interval
    with pg_sessions() as s:
        s.execute(sa.delete(tables.table(tables.outbox)))
        s.commit()
    assert loop.drain_once().claimed == 0
    assert (loop._until_due_s(), loop.stats.due_reads) == (loop.poll_interval_s, 0)
    loop.close()


def test_an_empty_claim_after_a_full_batch_keeps_the_due_time_the_mark_read(
        pg_sessions: sessionmaker[Session], pg_url: str, tmp_path: Path, clock: ManualClock, tables: Tables) -> None:
    # Given exactly one full batch of due rows and one row held for 3 s
    insert_pending(pg_sessions, clock.now_ms(), 2, tables=tables)
    schedule(pg_sessions, tables, clock.now_ms() + 3_000)
    loop = RelayLoop(settings=settings(tmp_path, pg_url), tables=tables, session_factory=pg_sessions,
                     publisher=InMemoryPublisher(), clock=clock, listen=False, batch_size=2)
    # When the drain publishes the full batch and claims the next one (empty) while it is in flight
    total = loop.drain_once()
    assert (total.batches, total.published) == (2, 2)
    # Then the wait is the held row's 3 s from the mark, not "due now" from the in-flight rows that
    # the empty claim saw pending (it did not read the due time: a batch of ours was in flight)
    assert (loop._until_due_s(), loop.stats.due_reads) == (3.0, 0)
    loop.close()


def test_the_notification_of_a_commit_the_claim_took_does_not_wake_the_loop_again(
        pg_sessions: sessionmaker[Session], pg_url: str, tmp_path: Path, clock: ManualClock, tables: Tables) -> None:
    # Given a listening loop and a commit of two rows whose NOTIFY has reached the loop's socket
    loop = RelayLoop(settings=settings(tmp_path, pg_url, relay_gather_ms=0), tables=tables,
                     session_factory=pg_sessions, publisher=InMemoryPublisher(), clock=clock)
    loop._ensure_listener()
    assert loop._listener is not None
    insert_pending(pg_sessions, clock.now_ms(), 2, tables=tables)
    assert select.select([loop._listener], [], [], 30)[0], "the NOTIFY never arrived"
    # When the loop drains, then waits
    assert loop.drain_once().published == 2
    loop._wait()
    # Then the claim took the notification with the rows: the wait ends by the poll, not by a NOTIFY
    assert (loop.stats.coalesced, loop.stats.notify_wakeups, loop.stats.poll_wakeups) == (1, 0, 1)
    # And a commit after the drain wakes it as before
    insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables)
    assert select.select([loop._listener], [], [], 30)[0], "the NOTIFY never arrived"
    loop._wait()
    assert loop.stats.notify_wakeups == 1
    loop.close()


def test_a_notify_gathers_while_commits_come_faster_than_the_window_and_not_at_a_trickle(
        pg_sessions: sessionmaker[Session], pg_url: str, tmp_path: Path, clock: ManualClock, tables: Tables) -> None:
    loop = RelayLoop(settings=settings(tmp_path, pg_url, relay_gather_ms=250, relay_poll_interval_s=30.0),
                     tables=tables, session_factory=pg_sessions, publisher=InMemoryPublisher(), clock=clock)
    loop._ensure_listener()
    # Given a loop that has seen no commit (a trickle), When one commit's NOTIFY wakes it,
    # Then it claims at once: one commit per second expects none within 250 ms
    insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables)
    loop._wait()
    assert (loop.stats.notify_wakeups, loop.stats.gathers) == (1, 0)
    assert loop.drain_once().published == 1
    # Given a burst of 50 commits whose notifications the claims read (_coalesce_notifies before each claim)
    for _ in range(50):
        insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables)
    deadline = time.monotonic() + 30
    while loop.stats.coalesced < 50 and time.monotonic() < deadline:
        loop.drain_once()
    assert loop.stats.coalesced >= 50, "the notifications of the burst never arrived"
    # When the next commit's NOTIFY wakes the loop, Then it gathers before claiming: about 50 commits in
    # the last second expect more within the window
    insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables)
    loop._wait()
    assert (loop.stats.notify_wakeups, loop.stats.gathers) == (2, 1)
    assert loop.commit_rate.expects_more(0.25, at=time.monotonic())
    assert loop.drain_once().published == 1
    loop.close()


def test_a_notify_does_not_gather_when_fewer_commits_than_gather_min_commits_are_expected(
        pg_sessions: sessionmaker[Session], pg_url: str, tmp_path: Path, clock: ManualClock, tables: Tables) -> None:
    # Given a loop with a 250 ms window whose commit rate is about 1.3 a second: a third of a commit expected
    # within the window, fewer than the GATHER_MIN_COMMITS a wait must serve
    loop = RelayLoop(settings=settings(tmp_path, pg_url, relay_gather_ms=250, relay_poll_interval_s=30.0),
                     tables=tables, session_factory=pg_sessions, publisher=InMemoryPublisher(), clock=clock)
    loop._ensure_listener()
    now = time.monotonic()
    for i in range(4):
        loop.commit_rate.add(1, at=now - 2 + i / 2)
    assert 0 < loop.commit_rate.per_s(at=time.monotonic()) * 0.25 < GATHER_MIN_COMMITS
    # When a commit's NOTIFY wakes it, Then it claims at once
    insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables)
    loop._wait()
    assert (loop.stats.notify_wakeups, loop.stats.gathers) == (1, 0)
    assert loop.drain_once().published == 1
    # And at about 40 a second (ten within the window), the next NOTIFY gathers
    now = time.monotonic()
    for i in range(40):
        loop.commit_rate.add(1, at=now - 1 + i / 40)
    insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables)
    loop._wait()
    assert (loop.stats.notify_wakeups, loop.stats.gathers) == (2, 1)
    assert loop.drain_once().published == 1
    loop.close()


QUEUE = "wk.tasks"


def task_row(version: int) -> ClaimedRow:
    return ClaimedRow(seq=1, message_id=uuid.uuid4(), type="t.send", payload={}, attempts=0, created_at_ms=0,
                      headers={"outbox_kind": TASK_KIND, "routing_key": QUEUE, workers.VERSION_HEADER: version})


def test_the_registry_is_reused_within_its_ttl_only_while_it_holds_nothing(
        pg_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    from celery_outbox.relay.dispatch import DeployHold

    hold = DeployHold(heartbeat_ms=10_000, recheck_ms=2_000)
    cache = RegistryCache.for_hold(hold)
    now = clock.now_ms()
    with pg_sessions() as s:
        workers.register(s, worker=uuid.uuid4(), name="w@h", queues=[QUEUE], tasks={"t.send": 1}, now_ms=now,
                         tables=tables)
    with pg_sessions() as s:
        # Given a registry read once (a live worker runs t.send v1)
        assert held_rows(s, [task_row(1)], now, hold=hold, tables=tables, cache=cache) == {}
        assert (cache.reads, cache.hits) == (1, 0)
        # When the next batch within the TTL holds nothing by it, Then it is not read again
        assert held_rows(s, [task_row(1)], now + cache.ttl_ms - 1, hold=hold, tables=tables, cache=cache) == {}
        assert (cache.reads, cache.hits) == (1, 1)
        # When a row the cached registry would hold comes (v2), Then the hold is decided on a fresh read
        assert held_rows(s, [task_row(2)], now + 1, hold=hold, tables=tables, cache=cache)
        assert cache.reads == 2
        # When the TTL has passed, Then the registry is read again
        assert held_rows(s, [task_row(1)], now + 1 + cache.ttl_ms, hold=hold, tables=tables, cache=cache) == {}
        assert cache.reads == 3


def test_a_fresh_read_lets_go_a_row_a_stale_registry_would_hold(
        pg_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    from celery_outbox.relay.dispatch import DeployHold

    hold = DeployHold(heartbeat_ms=10_000, recheck_ms=2_000)
    cache = RegistryCache.for_hold(hold)
    now = clock.now_ms()
    # Given a cached registry where the queue's only worker runs v1, and a database where it has gone
    cache.store(now, workers.Registry(queues={QUEUE: ({"t.send": 1},)}))
    with pg_sessions() as s:
        assert s.execute(sa.select(sa.func.count()).select_from(tables.table(tables.workers))).scalar() == 0
        # When a v2 row is claimed within the TTL, Then it goes out (the database says nobody holds it)
        assert held_rows(s, [task_row(2)], now + 1, hold=hold, tables=tables, cache=cache) == {}


def task_headers(mid: uuid.UUID) -> dict[str, object]:
    """A valid task row's headers (the shape celery/enqueue.py writes): one message to ``QUEUE``."""
    return {"outbox_kind": TASK_KIND, "routing_key": QUEUE, "exchange": "",
            "task_headers": {"task": "t.send", "id": str(mid)}}


def task_body(_i: int, _mid: uuid.UUID) -> dict[str, object]:
    return {"body": [[], {}, None]}


class Recorder:
    """What the relay's engine runs: each statement's kind, and the transactions begun and ended."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.kinds: list[str] = []
        self.statements: list[str] = []
        self.clauses: list[object] = []
        self.ends: list[str] = []

    def __enter__(self) -> Recorder:
        sa.event.listen(self.engine, "before_cursor_execute", self._sql)
        sa.event.listen(self.engine, "before_execute", self._clause)
        for name in ("begin", "commit", "rollback"):
            sa.event.listen(self.engine, name, getattr(self, f"_{name}"))
        return self

    def __exit__(self, *_: object) -> None:
        sa.event.remove(self.engine, "before_cursor_execute", self._sql)
        sa.event.remove(self.engine, "before_execute", self._clause)
        for name in ("begin", "commit", "rollback"):
            sa.event.remove(self.engine, name, getattr(self, f"_{name}"))

    def _sql(self, _c: object, _cur: object, statement: str, *_: object) -> None:
        self.statements.append(statement)
        s = " ".join(statement.split()).upper()
        # the claim runs as a prepared statement on psycopg2 (celery_outbox/prepared.py): EXECUTE is the claim,
        # PREPARE (once per connection) its preparation
        self.kinds.append("mark" if s.startswith("WITH MARKED AS") else "prepare" if s.startswith("PREPARE OUTBOX_")
                          else "claim" if "SKIP LOCKED" in s or s.startswith("EXECUTE OUTBOX_") else s[:60])

    def _clause(self, _c: object, clause: object, *_: object) -> None:
        self.clauses.append(clause)

    def _begin(self, _c: object) -> None:
        self.ends.append("BEGIN")

    def _commit(self, _c: object) -> None:
        self.ends.append("COMMIT")

    def _rollback(self, _c: object) -> None:
        self.ends.append("ROLLBACK")


def test_a_wake_up_that_publishes_one_commit_runs_one_statement_that_claims_and_marks_in_one_transaction(
        pg_engine: sa.Engine, pg_sessions: sessionmaker[Session], pg_url: str, tmp_path: Path, clock: ManualClock,
        tables: Tables) -> None:
    # Given a relay with the deploy hold on (workers register) that has run once: its leases are claimed,
    # its registry read, and a live worker runs the task (so the registry holds nothing)
    with pg_sessions() as s:
        workers.register(s, worker=uuid.uuid4(), name="w@h", queues=[QUEUE], tasks={"t.send": 1},
                         now_ms=clock.now_ms(), tables=tables)
    loop = RelayLoop(settings=settings(tmp_path, pg_url, worker_heartbeat_ms=10_000), tables=tables,
                     session_factory=pg_sessions, publisher=InMemoryPublisher(), clock=clock, listen=False)

    def wake_up() -> None:  # what ``outbox relay`` does per wake-up, but the wait itself
        loop.drain_once()
        loop.periodic_jobs()
        loop._until_due_s()

    insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables, type_="t.send", headers=task_headers,
                   payload=task_body)
    wake_up()
    # When a commit of events and a task row wakes it
    insert_pending(pg_sessions, clock.now_ms(), 3, tables=tables)
    insert_pending(pg_sessions, clock.now_ms(), 2, tables=tables, type_="t.send", headers=task_headers,
                   payload=task_body)
    with Recorder(pg_engine) as seen:
        wake_up()
    # Then it published them with BEGIN, the claim (which also stamps, counts and reads the next due time:
    # ``queries.claim_mark_pg``) and COMMIT: no mark of its own, no second transaction, no registry read, no
    # next-due query, no lease statement. A statement that comes back fails here.
    assert seen.kinds == ["claim"]  # prepared on this connection at the first wake-up, executed by name now
    prepared = loop.config.statements.claim_mark_prepared  # type: ignore[union-attr]
    assert prepared is not None and seen.statements[0] is prepared.execute_sql
    assert seen.ends == ["BEGIN", "COMMIT"]
    assert (loop.stats.published, loop._registry_cache is not None and loop._registry_cache.hits) == (6, 1)
    loop.close()


def test_a_wake_up_that_finds_nothing_runs_one_statement_that_claims_and_reads_the_due_time(
        pg_engine: sa.Engine, pg_sessions: sessionmaker[Session], pg_url: str, tmp_path: Path, clock: ManualClock,
        tables: Tables) -> None:
    # Given a relay that has run once (its leases claimed) and a row held for 3 s, nothing due
    loop = RelayLoop(settings=settings(tmp_path, pg_url), tables=tables, session_factory=pg_sessions,
                     publisher=InMemoryPublisher(), clock=clock, listen=False)
    loop.drain_once()
    loop.periodic_jobs()
    schedule(pg_sessions, tables, clock.now_ms() + 3_000)
    # When it wakes up (a poll, a NOTIFY whose row an earlier claim took) and finds nothing
    with Recorder(pg_engine) as seen:
        assert loop.drain_once().claimed == 0
        loop.periodic_jobs()
        wait = loop._until_due_s()
    # Then BEGIN, the claim (which read the next due time), COMMIT: no query and no session for the due time
    assert seen.kinds == ["claim"]
    assert seen.ends == ["BEGIN", "COMMIT"]
    assert wait == 3.0
    loop.close()


def test_the_relay_builds_its_claim_and_mark_once_not_per_wake_up(
        pg_engine: sa.Engine, pg_sessions: sessionmaker[Session], pg_url: str, tmp_path: Path, clock: ManualClock,
        tables: Tables) -> None:
    # Given a relay
    loop = RelayLoop(settings=settings(tmp_path, pg_url), tables=tables, session_factory=pg_sessions,
                     publisher=InMemoryPublisher(), clock=clock, listen=False)
    # When two wake-ups each claim and mark a commit's rows
    kinds, claims = [], []
    for _ in range(2):
        insert_pending(pg_sessions, clock.now_ms(), 2, tables=tables)
        with Recorder(pg_engine) as seen:
            assert loop.drain_once().published == 2
        kinds.append(seen.kinds)
        claims.append(seen.statements)
    # Then the first prepared the claim on its connection (psycopg2: celery_outbox/prepared.py) and both executed
    # it by name; its text was compiled once for the relay (``RelayStatements.claim_mark_sql``: no statement
    # built, no cache key computed and no compile-cache lookup per wake-up), and it is the SQL of claim_mark_pg,
    # whose claim is due_pending's (the partial index's predicate word for word, its order, limit and SKIP LOCKED)
    assert kinds == [["prepare", "claim"], ["claim"]]
    prepared = loop.config.statements.claim_mark_prepared  # type: ignore[union-attr]
    assert prepared is not None and claims[0][1] is claims[1][0] is prepared.execute_sql
    assert prepared.text is loop.config.statements.claim_mark_sql  # type: ignore[union-attr]
    dialect = pg_engine.dialect
    text = prepared.text
    assert text == str(claim_mark_pg(tables, dialect).compile(dialect=dialect))
    outbox = dialect.identifier_preparer.format_table(tables.table(tables.outbox))
    assert (f"SELECT seq FROM {outbox} WHERE {PENDING_SQL} AND next_attempt_at_ms <= %(now_ms)s ORDER BY "
            "next_attempt_at_ms, seq LIMIT %(claim_limit)s FOR UPDATE SKIP LOCKED") in text
    loop.close()


def test_a_reconcile_pass_that_finds_nothing_to_send_is_one_transaction(  # its counters read once, written once
        pg_engine: sa.Engine, pg_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    from celery_outbox.relay.reconcile import reconcile

    def run() -> None:
        with pg_sessions() as s:
            reconcile(s, InMemoryPublisher(), clock, tables=tables, routes={"OrderPlaced": ("shipping",)},
                      namespace="wk", max_message_bytes=1 << 20, older_than_ms=1_000, plain_older_than_ms=5_000)

    # Given a first pass (it only sets both windows' watermarks) and a row published since, with its inbox row
    run()
    mid = insert_pending(pg_sessions, clock.now_ms(), 1, tables=tables)[0]
    with pg_sessions() as s:
        s.execute(sa.update(tables.table(tables.outbox)).values(published_at_ms=clock.now_ms()))
        s.add(tables.inbox(message_id=mid, consumer="shipping", type="OrderPlaced", processed_at_ms=clock.now_ms()))
        s.commit()
    clock.advance(10_000)
    # When the next pass runs (every few seconds, under the lease)
    with Recorder(pg_engine) as seen:
        run()
    # Then one transaction (nothing to publish: no lock held across a broker call): every counter of the pass
    # read (and locked) in one statement, the consumers' progress (inbox and receipts in one statement), whether
    # anything was published in the windows' spans (yes), the events window's page and the inbox, parked,
    # dead-letter and attempts reads of its one row, the plain-task window's page, and one upsert of the
    # watermarks and the progress
    assert seen.ends == ["BEGIN", "COMMIT"]
    tables_read = [k.split(" FROM ", 1)[1].split(" ")[0] if k.startswith("SELECT") else k.split(" ")[2] for k in
                   (" ".join(st.split()).upper() for st in seen.statements)]
    assert tables_read == ["OUTBOX_COUNTERS", "OUTBOX_INBOX", "OUTBOX_MESSAGES", "OUTBOX_MESSAGES", "OUTBOX_INBOX",
                           "OUTBOX_PARKED", "OUTBOX_DEAD_LETTERS", "OUTBOX_ATTEMPTS", "OUTBOX_MESSAGES",
                           "OUTBOX_COUNTERS"]
    # And the watermarks moved: a second run over the same window checks nothing again
    with pg_sessions() as s:
        again = reconcile(s, InMemoryPublisher(), clock, tables=tables, routes={"OrderPlaced": ("shipping",)},
                          namespace="wk", max_message_bytes=1 << 20, older_than_ms=1_000, plain_older_than_ms=5_000)
    assert (again.checked, again.plain_checked, again.republished) == (0, 0, 0)
