"""Two parallel deliveries of one message on real Postgres (rule 6): one PROCESSED, one DUPLICATE,
one effect. The plain and ordered paths read nothing before their claim (``INSERT ... ON CONFLICT DO
NOTHING``: the second waits on the first's row lock, then inserts nothing); the e-mail consumer's
``prepare`` step keeps a read first (``fast_path``), run here on and off, both threads passing it
before either commits."""

from __future__ import annotations

import threading
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.clock import ManualClock
from celery_outbox.consumer import ConsumerRegistry
from celery_outbox.inbox import handle as inbox
from celery_outbox.inbox.claim import Handler, already_seen
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from consumers.billing import billing
from consumers.effects import duplicates_absorbed, effect_counts, email_provider_calls
from consumers.email import email
from consumers.search import search
from consumers.shipping import shipping
from consumers.testing import order_placed_envelope

pytestmark = pytest.mark.postgres
ROUNDS = 5


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "no-fast-path"])
@pytest.mark.parametrize("name", ["shipping", "search", "email"])
def test_same_message_twice_in_parallel(pg_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables,
                                        monkeypatch: pytest.MonkeyPatch, fast_path: bool, name: str) -> None:
    spec = ConsumerRegistry(specs=[shipping, billing, search, email]).with_options(fast_path=fast_path)[name]
    real_seen = already_seen  # what handle() calls, patched in its module below
    after_fast_path = threading.Barrier(2)

    def seen_then_wait(session: Session, message_id: uuid.UUID, consumer: str, *, tables: Tables) -> bool:
        # Both deliveries answer "not seen" before either claims: the worst interleaving (prepare only).
        seen = real_seen(session, message_id, consumer, tables=tables)
        after_fast_path.wait(timeout=30)
        return seen

    monkeypatch.setattr(inbox, "already_seen", seen_then_wait)
    for i in range(ROUNDS):
        # Given one message delivered to two workers at the same moment
        env = order_placed_envelope(f"o-{i}")
        start = threading.Barrier(2)
        outcomes: list[Outcome] = []
        errors: list[BaseException] = []

        def deliver(env: Envelope, start: threading.Barrier, outcomes: list[Outcome],
                    errors: list[BaseException]) -> None:
            try:
                with pg_sessions() as s:
                    start.wait(timeout=30)
                    outcomes.append(spec.handle(s, env, tables=tables, clock=clock))
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=deliver, args=(env, start, outcomes, errors)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        # Then one PROCESSED and one DUPLICATE
        assert errors == []
        assert sorted(o.value for o in outcomes) == ["duplicate", "processed"]
    # And one effect and one inbox row per message
    with pg_sessions() as s:
        assert effect_counts(s)[name] == ROUNDS
        assert s.execute(sa.select(sa.func.count()).select_from(tables.inbox)).scalar_one() == ROUNDS
        assert duplicates_absorbed(s, tables) == {name: ROUNDS}
        if name == "email":
            # with the fast path racing, both called the provider; the key made it one e-mail each
            assert email_provider_calls(s) == 2 * ROUNDS


def test_versions_of_one_entity_in_parallel_apply_in_order(pg_sessions: sessionmaker[Session], clock: ManualClock,
                                                           tables: Tables) -> None:
    """Ordering under concurrency: the version row is advanced (or locked, when that fails) by one statement,
    so racing deliveries of versions 1..N apply each version once, in order, whatever the interleaving."""
    versions = 6
    for i in range(ROUNDS):
        applied: list[int] = []
        lock = threading.Lock()

        def record(session: Session, env: Envelope, applied: list[int] = applied, lock: threading.Lock = lock) -> None:
            with lock:
                applied.append(int(env.headers["entity_version"]))

        # Given versions 1..N of one entity delivered at the same moment, newest first to the thread pool
        envs = [order_placed_envelope(f"e-{i}", version=v) for v in range(versions, 0, -1)]
        start = threading.Barrier(len(envs))
        outcomes: list[Outcome] = []
        errors: list[BaseException] = []

        def deliver(env: Envelope, start: threading.Barrier = start, outcomes: list[Outcome] = outcomes,
                    errors: list[BaseException] = errors, record: Handler = record) -> None:
            try:
                with pg_sessions() as s:
                    start.wait(timeout=30)
                    outcomes.append(inbox.handle(s, env, tables=tables, consumer="ledger", handler=record, clock=clock,
                                                 ordering=True, park_timeout_ms=60_000))
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=deliver, args=(env,)) for env in envs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        # Then every version is applied exactly once, in order; the early ones were parked, none is left
        assert errors == []
        assert applied == list(range(1, versions + 1))
        assert set(outcomes) <= {Outcome.PROCESSED, Outcome.PARKED} and len(outcomes) == versions
        with pg_sessions() as s:
            assert s.get(tables.entity_versions, ("ledger", f"order:e-{i}")).version == versions  # type: ignore[union-attr]
            assert s.execute(sa.select(sa.func.count()).select_from(tables.parked)).scalar_one() == 0
            assert s.execute(sa.select(sa.func.count()).select_from(tables.inbox)
                             .where(tables.inbox.consumer == "ledger")).scalar_one() == versions * (i + 1)
