"""Two parallel deliveries of one message on real Postgres (rule 6): one PROCESSED, one DUPLICATE,
one effect, with the fast path on (both threads pass it before either commits) and off."""

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
    real_seen = inbox.already_seen
    after_fast_path = threading.Barrier(2)

    def seen_then_wait(session: Session, message_id: uuid.UUID, consumer: str, *, tables: Tables) -> bool:
        # Both deliveries answer "not seen" before either claims: the worst interleaving.
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
