"""The inbox (rule 6): effect + (message_id, consumer) row in one transaction; the key is the guarantee.

Every idempotency test runs with the "already seen?" fast path on AND off, on SQLite and Postgres.
Only a consumer with a ``prepare`` step (e-mail) reads the inbox first; for the others the claim itself
reports the duplicate, so both settings must give the same results.
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.consumer import ConsumerRegistry
from celery_outbox.errors import MalformedMessageError, UnknownEventTypeError
from celery_outbox.inbox import handle as inbox
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from consumers.billing import billing
from consumers.effects import duplicates_absorbed, effect_counts, email_provider_calls
from consumers.email import email
from consumers.models import Invoice, SearchDocument, SentEmail, Shipment
from consumers.search import search
from consumers.shipping import shipping
from consumers.testing import order_placed_envelope


def deployment_consumers() -> ConsumerRegistry:
    """The four example consumers of the reference deployment (``consumers/``), e-mail included."""
    return ConsumerRegistry(specs=[shipping, billing, search, email])


FAST_PATH = pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "no-fast-path"])


class SimulatedCrash(BaseException):
    """Stands in for SIGKILL at a crash point (BaseException: no handler may swallow it)."""


class CrashAt:
    def __init__(self, name: str) -> None:
        self.name = name

    def reached(self, name: str) -> None:
        if name == self.name:
            raise SimulatedCrash(name)


def count(sessions: sessionmaker[Session], model: type) -> int:
    with sessions() as s:
        return int(s.execute(sa.select(sa.func.count()).select_from(model)).scalar_one())


def ship(sessions: sessionmaker[Session], tables: Tables, env: Envelope, clock: ManualClock, *, fast_path: bool,
         crash: CrashAt | None = None) -> Outcome:
    with sessions() as s:
        return inbox.handle(s, env, tables=tables, consumer="shipping", handler=shipping, clock=clock, fast_path=fast_path,
                            crash_points=crash)


@FAST_PATH
def test_same_message_twice_sequentially(any_sessions: sessionmaker[Session], clock: ManualClock,
                                         fast_path: bool, tables: Tables) -> None:
    # Given one OrderPlaced
    env = order_placed_envelope("o-1")
    # When it is delivered twice
    first = ship(any_sessions, tables, env, clock, fast_path=fast_path)
    second = ship(any_sessions, tables, env, clock, fast_path=fast_path)
    # Then one PROCESSED, one DUPLICATE, one inbox row, one effect, one duplicate counted
    assert (first, second) == (Outcome.PROCESSED, Outcome.DUPLICATE)
    assert count(any_sessions, tables.inbox) == 1
    assert count(any_sessions, Shipment) == 1
    with any_sessions() as s:
        assert duplicates_absorbed(s, tables) == {"shipping": 1}
        row = s.get(tables.inbox, (env.message_id, "shipping"))
        assert row is not None and row.processed_at_ms == clock.now_ms() and row.type == "OrderPlaced"


@FAST_PATH
def test_each_consumer_has_its_own_inbox_key(any_sessions: sessionmaker[Session], clock: ManualClock,
                                             fast_path: bool, tables: Tables) -> None:
    env = order_placed_envelope("o-1")
    registry = deployment_consumers().with_options(fast_path=fast_path)
    with any_sessions() as s:
        outcomes = [registry[name].handle(s, env, tables=tables, clock=clock) for name in ("shipping", "billing")]
    assert outcomes == [Outcome.PROCESSED, Outcome.PROCESSED]
    assert count(any_sessions, tables.inbox) == 2


@FAST_PATH
def test_effect_write_fails_once_then_retry_succeeds_once(any_sessions: sessionmaker[Session], clock: ManualClock,
                                                          fast_path: bool, tables: Tables) -> None:
    # Given a Shipping handler whose effect write fails on the first delivery (NOT NULL violation)
    calls: list[int] = []

    def flaky(session: Session, env: Envelope) -> None:
        calls.append(1)
        if len(calls) == 1:
            session.add(Shipment(order_id="o-1", address_line="", items=None, created_at_ms=0))
            session.flush()
        shipping(session, env)

    env = order_placed_envelope("o-1")
    # When it is delivered: the effect fails
    with any_sessions() as s, pytest.raises(sa.exc.IntegrityError):
        inbox.handle(s, env, tables=tables, consumer="shipping", handler=flaky, clock=clock, fast_path=fast_path)
    # Then nothing at all was written: no effect, no inbox row (not even a duplicate counted)
    assert count(any_sessions, Shipment) == 0
    assert count(any_sessions, tables.inbox) == 0
    with any_sessions() as s:
        assert duplicates_absorbed(s, tables) == {}
    # When it is redelivered: processed once
    with any_sessions() as s:
        outcome = inbox.handle(s, env, tables=tables, consumer="shipping", handler=flaky, clock=clock, fast_path=fast_path)
    assert outcome is Outcome.PROCESSED
    assert count(any_sessions, Shipment) == 1
    assert count(any_sessions, tables.inbox) == 1
    assert len(calls) == 2


def test_handler_exception_rolls_back_and_propagates(sqlite_sessions: sessionmaker[Session],
                                                     clock: ManualClock, tables: Tables) -> None:
    def boom(session: Session, env: Envelope) -> None:
        shipping(session, env)
        session.flush()
        raise RuntimeError("downstream said no")

    with sqlite_sessions() as s, pytest.raises(RuntimeError, match="downstream said no"):
        inbox.handle(s, order_placed_envelope(), tables=tables, consumer="shipping", handler=boom, clock=clock)
    assert count(sqlite_sessions, Shipment) == 0
    assert count(sqlite_sessions, tables.inbox) == 0


def test_a_unique_violation_of_the_effect_is_not_a_duplicate(any_sessions: sessionmaker[Session],
                                                             clock: ManualClock, tables: Tables) -> None:
    # Given a handler whose own write violates a unique key (not the inbox's)
    def twice(session: Session, env: Envelope) -> None:
        for _ in range(2):
            session.add(SearchDocument(order_id="o-1", body={}, version=1, updated_at_ms=0))
            session.flush()

    # When it runs, Then the error propagates (redelivery), it is not mistaken for a duplicate
    with any_sessions() as s, pytest.raises(sa.exc.IntegrityError):
        inbox.handle(s, order_placed_envelope(), tables=tables, consumer="search", handler=twice, clock=clock)
    assert count(any_sessions, tables.inbox) == 0


def test_mirror_bug_loses_the_effect(sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    """The design forbids committing the inbox row before (and apart from) the effect. Here is why."""

    def broken_handle(session: Session, env: Envelope) -> None:
        # The mirror bug: mark the message seen in its own transaction, then do the effect.
        session.add(tables.inbox(message_id=env.message_id, consumer="shipping", type=env.type,
                               processed_at_ms=clock.now_ms()))
        session.commit()
        raise SimulatedCrash("killed between the inbox commit and the effect")

    env = order_placed_envelope("o-1")
    # Given the broken consumer crashes between its two transactions
    with sqlite_sessions() as s, pytest.raises(SimulatedCrash):
        broken_handle(s, env)
    # When the broker redelivers to the (correct) consumer
    outcome = ship(sqlite_sessions, tables, env, clock, fast_path=True)
    # Then the inbox says "seen", so the effect is skipped: the shipment is lost for good
    assert outcome is Outcome.DUPLICATE
    assert count(sqlite_sessions, Shipment) == 0
    assert count(sqlite_sessions, tables.inbox) == 1

    # Contrast: the real handle() crashing at the same moment (before its single commit) loses nothing
    env2 = order_placed_envelope("o-2")
    with pytest.raises(SimulatedCrash):
        ship(sqlite_sessions, tables, env2, clock, fast_path=True, crash=CrashAt("consumer_before_commit"))
    assert ship(sqlite_sessions, tables, env2, clock, fast_path=True) is Outcome.PROCESSED
    with sqlite_sessions() as s:
        assert s.execute(sa.select(Shipment.order_id)).scalars().all() == ["o-2"]


@FAST_PATH
def test_crash_after_commit_before_ack_is_absorbed(any_sessions: sessionmaker[Session], clock: ManualClock,
                                                   fast_path: bool, tables: Tables) -> None:
    # Given the worker dies after the inbox commit, before acking
    env = order_placed_envelope("o-1")
    with pytest.raises(SimulatedCrash):
        ship(any_sessions, tables, env, clock, fast_path=fast_path, crash=CrashAt("consumer_after_commit_before_ack"))
    # When the broker redelivers, Then it is a DUPLICATE and there is still one shipment
    assert ship(any_sessions, tables, env, clock, fast_path=fast_path) is Outcome.DUPLICATE
    assert count(any_sessions, Shipment) == 1


@FAST_PATH
def test_fan_out_one_order_placed_one_effect_per_consumer(any_sessions: sessionmaker[Session], clock: ManualClock,
                                                          fast_path: bool, tables: Tables) -> None:
    # Given one OrderPlaced routed to shipping, billing, search and email
    env = order_placed_envelope("o-7", quantity=3, unit_price_cents=1000)
    registry = deployment_consumers().with_options(fast_path=fast_path)
    # When each consumer receives it twice
    with any_sessions() as s:
        first = {spec.name: spec.handle(s, env, tables=tables, clock=clock) for spec in registry}
        second = {spec.name: spec.handle(s, env, tables=tables, clock=clock) for spec in registry}
    # Then exactly one Shipment, one Invoice, one search document and one e-mail
    assert set(first.values()) == {Outcome.PROCESSED}
    assert set(second.values()) == {Outcome.DUPLICATE}
    with any_sessions() as s:
        assert effect_counts(s) == {"shipping": 1, "billing": 1, "search": 1, "email": 1}
        assert duplicates_absorbed(s, tables) == {"billing": 1, "email": 1, "search": 1, "shipping": 1}
        shipment = s.execute(sa.select(Shipment)).scalar_one()
        assert (shipment.order_id, shipment.items) == ("o-7", 3)
        invoice = s.execute(sa.select(Invoice)).scalar_one()
        assert (invoice.order_id, invoice.amount_cents, invoice.currency) == ("o-7", 3000, "EUR")
        doc = s.get(SearchDocument, "o-7")
        assert doc is not None and doc.body["total_cents"] == 3000 and doc.version == 1
        mail = s.execute(sa.select(SentEmail)).scalar_one()
        assert mail.idempotency_key == f"email:{env.message_id}" and mail.to == "ada@example.com"
        # Without the fast path the duplicate reaches the provider, which the key absorbs.
        assert email_provider_calls(s) == (1 if fast_path else 2)


@FAST_PATH
def test_email_crash_after_send_before_commit_sends_once(any_sessions: sessionmaker[Session], clock: ManualClock,
                                                         fast_path: bool, tables: Tables) -> None:
    # Given the e-mail consumer dies after the provider call, before its inbox commit
    spec = deployment_consumers()["email"]
    env = order_placed_envelope("o-1")
    with any_sessions() as s, pytest.raises(SimulatedCrash):
        spec.handle(s, env, tables=tables, clock=clock, crash_points=CrashAt("consumer_before_commit"), fast_path=fast_path)
    # When it is redelivered
    with any_sessions() as s:
        outcome = spec.handle(s, env, tables=tables, clock=clock, fast_path=fast_path)
    # Then the provider was called twice with one key and sent one e-mail; the inbox has one row
    assert outcome is Outcome.PROCESSED
    with any_sessions() as s:
        assert effect_counts(s)["email"] == 1
        assert email_provider_calls(s) == 2
    assert count(any_sessions, tables.inbox) == 1


def test_consumer_refuses_an_event_type_it_does_not_handle(sqlite_sessions: sessionmaker[Session],
                                                           clock: ManualClock, tables: Tables) -> None:
    env = Envelope(message_id=uuid.uuid4(), type="OrderCancelled", payload={"order_id": "o-1"})
    with sqlite_sessions() as s, pytest.raises(UnknownEventTypeError, match="does not handle event type"):
        deployment_consumers()["shipping"].handle(s, env, tables=tables, clock=clock)
    assert count(sqlite_sessions, tables.inbox) == 0


def test_payload_missing_a_field_is_malformed_and_writes_nothing(sqlite_sessions: sessionmaker[Session],
                                                                 clock: ManualClock, tables: Tables) -> None:
    good = order_placed_envelope("o-1")
    payload = {k: v for k, v in good.payload.items() if k != "order_id"}
    env = Envelope(message_id=good.message_id, type=good.type, payload=payload, headers=good.headers)
    for name in ("shipping", "billing", "search", "email"):
        with sqlite_sessions() as s, pytest.raises(MalformedMessageError, match="missing required field 'order_id'"):
            deployment_consumers()[name].handle(s, env, tables=tables, clock=clock)
    with sqlite_sessions() as s:
        assert effect_counts(s) == {"shipping": 0, "billing": 0, "search": 0, "email": 0}
    assert count(sqlite_sessions, tables.inbox) == 0
