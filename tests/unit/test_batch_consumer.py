"""Batch consumers without Celery: the declaration, the one-statement claim of a batch, and the guarantee per
message inside a batch (docs/tasks.md, "Batch consumers"), on SQLite and real Postgres."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import counters
from celery_outbox.batch_delivery import BatchItem, deliver_batch
from celery_outbox.clock import ManualClock
from celery_outbox.consumer import ConsumerSpec, consumer
from celery_outbox.errors import ConfigError, OutboxError
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.outbox import Outbox
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings
from celery_outbox.sql import insert_for
from tests.unit.test_inbox_claim import kinds, recorded

DOCS = sa.Table("batch_test_docs", sa.MetaData(), sa.Column("order_id", sa.String(64), primary_key=True),
                sa.Column("effects", sa.Integer, nullable=False))


@pytest.fixture
def sessions(any_sessions: sessionmaker[Session]) -> Iterator[sessionmaker[Session]]:
    engine = any_sessions.kw["bind"]
    DOCS.create(engine, checkfirst=True)
    yield any_sessions
    DOCS.drop(engine, checkfirst=True)


class Index:
    """A search-like bulk effect: one upsert of every document of the batch; records each call's size."""

    def __init__(self, *, poison: frozenset[str] = frozenset(), clash: frozenset[str] = frozenset()) -> None:
        self.calls: list[list[str]] = []
        self.poison = poison  # an order whose message always fails
        self.clash = clash  # orders that fail only together in one batch (a neighbour's fault, not theirs)

    def __call__(self, session: Session, events: list[Envelope]) -> None:
        ids = [str(e.payload["order_id"]) for e in events]
        self.calls.append(ids)
        bad = self.poison.intersection(ids)
        if bad:
            raise ValueError(f"cannot index {sorted(bad)[0]}")
        if self.clash and self.clash <= set(ids):
            raise RuntimeError("these two cannot share a batch")
        stmt = insert_for(session, DOCS).values([{"order_id": i, "effects": 1} for i in ids])
        session.execute(stmt.on_conflict_do_update(index_elements=["order_id"],
                                                   set_={"effects": DOCS.c.effects + 1}))


def spec_of(index: Index, *, max_retries: int | None = 2) -> ConsumerSpec:
    return consumer(name="search", event="OrderPlaced", batch_size=100, max_retries=max_retries)(index)


def envelope(order_id: str, message_id: uuid.UUID | None = None) -> Envelope:
    return Envelope(message_id=message_id or uuid.uuid4(), type="OrderPlaced", payload={"order_id": order_id})


def item(env: Envelope, **flags: Any) -> BatchItem:
    return BatchItem(body=json.dumps(env.to_dict()), **flags)


def effects(sessions: sessionmaker[Session]) -> dict[str, int]:
    with sessions() as s:
        return {str(k): int(v) for k, v in s.execute(sa.select(DOCS.c.order_id, DOCS.c.effects))}


def rows(sessions: sessionmaker[Session], model: Any) -> int:
    with sessions() as s:
        return int(s.execute(sa.select(sa.func.count()).select_from(model)).scalar_one())


def counter(sessions: sessionmaker[Session], tables: Tables, name: str) -> int:
    with sessions() as s:
        return counters.value(s, "search", name, tables=tables)


# -- declaring one ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("options", "message"), [
    ({"batch_size": 0}, "batch_size must be an integer from 1 to 1000, got 0"),
    ({"batch_size": 1001}, "batch_size must be an integer from 1 to 1000"),
    ({"batch_size": True}, "batch_size must be an integer"),
    ({"batch_size": "10"}, "batch_size must be an integer"),
    ({"batch_size": 10, "batch_wait_ms": -1}, "batch_wait_ms must be an integer from 0 to 10000, got -1"),
    ({"batch_size": 10, "batch_wait_ms": 10_001}, "batch_wait_ms must be an integer from 0 to 10000"),
    ({"batch_wait_ms": 20}, "batch_wait_ms needs batch_size"),
    ({"batch_size": 10, "ordering": True}, "per-entity ordered consumer \\(ordering=True\\) cannot take batch_size"),
    ({"batch_size": 10, "prepare": lambda s, e: None}, "prepare step cannot take batch_size"),
])
def test_bad_batch_options_are_refused_with_a_config_error(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        consumer(name="search", event="OrderPlaced", **options)
    assert isinstance(caught.value, OutboxError)


def test_outbox_consumer_declares_a_batch_consumer_whose_single_path_passes_a_list_of_one() -> None:
    outbox = Outbox(Celery("t", broker_url="memory://", set_as_current=False),
                    settings=Settings(database_url="sqlite://"))
    seen: list[list[Envelope]] = []

    @outbox.consumer("OrderPlaced", name="search", batch_size=100, batch_wait_ms=20)
    def index(session: Session, events: list[Envelope]) -> None:
        seen.append(events)

    assert (index.batch_size, index.batch_wait_ms, index.batch_handler) == (100, 20, index.batch_handler)
    assert outbox.registry["search"] is index and outbox.task("search") is not None
    one = envelope("o-1")
    index.handler(None, one)  # type: ignore[arg-type]  # a retried message runs alone: a list of one
    assert seen == [[one]]
    plain = outbox.consumer("OrderPlaced", name="shipping")(lambda s, e: None)
    assert (plain.batch_size, plain.batch_handler) == (None, None)
    assert consumer(name="x", event="E", batch_size=5)(index.batch_handler).batch_wait_ms == 50  # type: ignore[arg-type]


def test_flask_outbox_declares_a_batch_consumer_at_import(tmp_path: Any) -> None:
    from flask import Flask

    from celery_outbox.contrib.flask import FlaskOutbox

    front = FlaskOutbox()

    @front.consumer("OrderPlaced", name="search", batch_size=10, batch_wait_ms=5)
    def index(session: Session, events: list[Envelope]) -> None:
        pass

    with pytest.raises(ConfigError, match="cannot take batch_size"):
        front.consumer("OrderPlaced", name="ordered", ordering=True, batch_size=10)
    app = Flask(f"batch{uuid.uuid4().hex[:6]}")
    app.config.update(OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'f.db'}", CELERY={"broker_url": "memory://localhost/"})
    outbox = front.init_app(app)
    spec = outbox.registry["search"]
    assert (spec.batch_size, spec.batch_wait_ms, spec.batch_handler) == (10, 5, index.batch_handler)
    assert outbox.task("search").outbox_batch_size == 10  # the task batches in a worker (celery/batch_tasks.py)
    outbox.close()


# -- the batch's inbox: one claim statement, one commit ---------------------------------------------

def test_a_batch_claims_every_inbox_row_in_one_statement_and_commits_once(
        sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    index = Index()
    batch = [envelope(f"o-{i}") for i in range(5)]
    with recorded(sessions) as seen, sessions() as s:
        outcomes = spec_of(index).handle_batch(s, batch, tables=tables, clock=clock)
    assert outcomes == [Outcome.PROCESSED] * 5
    statements = kinds(seen, tables)
    assert statements.count("INSERT inbox") == 1  # the whole batch's claim
    assert statements.count("COMMIT") == 1  # effect + inbox rows + counters together
    assert statements.index("INSERT inbox") < next(i for i, k in enumerate(statements) if k == "INSERT ?")
    assert index.calls == [[f"o-{i}" for i in range(5)]]
    assert effects(sessions) == {f"o-{i}": 1 for i in range(5)}
    assert rows(sessions, tables.inbox) == 5
    assert (counter(sessions, tables, counters.BATCHES), counter(sessions, tables, counters.BATCHED_MESSAGES)) == (1, 5)



@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_every_postgres_driver_claims_a_batch_as_one_statement_of_arrays(pg_url: str, driver: str, clock: ManualClock,
                                                                          tables: Tables) -> None:
    from celery_outbox.db import make_engine, make_session_factory
    from celery_outbox.inbox.batch import claim_many

    # Given the same database through psycopg2 and through psycopg 3, and a message already claimed
    engine = make_engine(pg_url.replace("postgresql://", f"postgresql+{driver}://", 1))
    sessions = make_session_factory(engine)
    earlier, a, b = envelope("o-early"), envelope("o-a"), envelope("o-b")
    try:
        with sessions() as s:
            assert claim_many(s, [earlier], tables=tables, consumer="search", now_ms=1) == {earlier.message_id}
            s.commit()
        # When a batch holding it and two new ones is claimed
        with recorded(sessions) as seen, sessions() as s:
            claimed = claim_many(s, [b, earlier, a], tables=tables, consumer="search", now_ms=2)
            s.commit()
        # Then only the new ones are this batch's, in ONE statement that binds the batch as arrays (its text is
        # the same for any batch size), and their rows are committed
        assert claimed == {a.message_id, b.message_id}
        assert kinds(seen, tables) == ["INSERT inbox", "COMMIT"] and "unnest" in seen[0]
        with sessions() as s:
            assert {m: t for m, t in s.execute(sa.select(tables.inbox.message_id, tables.inbox.processed_at_ms))} == {
                earlier.message_id: 1, a.message_id: 2, b.message_id: 2}
    finally:
        engine.dispose()

def test_duplicates_inside_the_batch_and_from_earlier_are_absorbed_and_counted(
        sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    index = Index()
    spec = spec_of(index)
    earlier, a, b = envelope("o-early"), envelope("o-a"), envelope("o-b")
    with sessions() as s:
        assert spec.handle_batch(s, [earlier], tables=tables, clock=clock) == [Outcome.PROCESSED]
    # Given a batch holding a message already processed, and another one twice
    with sessions() as s:
        outcomes = spec.handle_batch(s, [a, earlier, b, a], tables=tables, clock=clock)
    # Then the handler saw each first delivery once, in arrival order; the others were absorbed and counted
    assert outcomes == [Outcome.PROCESSED, Outcome.DUPLICATE, Outcome.PROCESSED, Outcome.DUPLICATE]
    assert index.calls == [["o-early"], ["o-a", "o-b"]]
    assert effects(sessions) == {"o-early": 1, "o-a": 1, "o-b": 1}
    assert counter(sessions, tables, counters.DUPLICATES) == 2
    # A batch of nothing but duplicates calls no handler and commits only its counts
    with sessions() as s:
        assert spec.handle_batch(s, [b, a], tables=tables, clock=clock) == [Outcome.DUPLICATE] * 2
    assert len(index.calls) == 2 and counter(sessions, tables, counters.DUPLICATES) == 4
    assert (counter(sessions, tables, counters.BATCHES), counter(sessions, tables, counters.BATCHED_MESSAGES)) == (3, 7)


def test_a_handler_that_raises_rolls_the_whole_batch_back(
        sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    spec = spec_of(Index(poison=frozenset({"o-2"})))
    with sessions() as s, pytest.raises(ValueError, match="cannot index o-2"):
        spec.handle_batch(s, [envelope("o-1"), envelope("o-2")], tables=tables, clock=clock)
    assert (effects(sessions), rows(sessions, tables.inbox), counter(sessions, tables, counters.BATCHES)) == ({}, 0, 0)


# -- the guarantee per message inside a batch -------------------------------------------------------

def test_a_poison_message_is_isolated_dead_lettered_alone_and_its_neighbours_are_processed_uncounted(
        sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    index = Index(poison=frozenset({"o-5"}))
    spec = spec_of(index, max_retries=2)  # at most 3 deliveries
    batch = [envelope(f"o-{i}") for i in range(8)]
    settings = Settings()
    # When the batch is delivered
    results = deliver_batch(sessions, spec, [item(e) for e in batch], tables=tables, settings=settings, clock=clock)
    # Then every neighbour is processed in the same pass; the poison message is counted once and retried
    assert [r.outcome for r in results] == [Outcome.PROCESSED] * 5 + [Outcome.RETRY] + [Outcome.PROCESSED] * 2
    assert results[5].deliveries == 1 and results[5].retry_in_s is not None
    assert results[5].error == "ValueError: cannot index o-5"
    assert effects(sessions) == {f"o-{i}": 1 for i in range(8) if i != 5}
    with sessions() as s:
        counted = {str(m): d for m, d in s.execute(sa.select(tables.attempts.message_id, tables.attempts.deliveries))}
    assert counted == {str(batch[5].message_id): 1}  # no neighbour counted for its failure
    assert index.calls[0] == [f"o-{i}" for i in range(8)]
    assert index.calls.count(["o-5"]) == 2  # bisected down to itself, then its own counted delivery
    # When its retries come back (alone: a retried message is never batched), it is dead-lettered at its limit
    retried = item(batch[5], first_delivery=False)
    second = deliver_batch(sessions, spec, [retried], tables=tables, settings=settings, clock=clock)
    third = deliver_batch(sessions, spec, [retried], tables=tables, settings=settings, clock=clock)
    assert [(r.outcome, r.deliveries) for r in second + third] == [(Outcome.RETRY, 2), (Outcome.DEAD_LETTERED, 3)]
    with sessions() as s:
        dead = s.execute(sa.select(tables.dead_letters.message_id, tables.dead_letters.last_error,
                                   tables.dead_letters.delivery_count)).all()
    assert [(str(m), e, n) for m, e, n in dead] == [(str(batch[5].message_id), "ValueError: cannot index o-5", 3)]
    assert rows(sessions, tables.inbox) == 7


def test_messages_that_fail_only_together_are_both_processed_and_never_counted(
        sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    index = Index(clash=frozenset({"o-0", "o-3"}))
    batch = [envelope(f"o-{i}") for i in range(4)]
    results = deliver_batch(sessions, spec_of(index), [item(e) for e in batch], tables=tables, settings=Settings(),
                            clock=clock)
    assert [r.outcome for r in results] == [Outcome.PROCESSED] * 4
    assert effects(sessions) == {f"o-{i}": 1 for i in range(4)}
    assert rows(sessions, tables.attempts) == 0 and rows(sessions, tables.dead_letters) == 0
    assert index.calls[0] == ["o-0", "o-1", "o-2", "o-3"] and index.calls[1:] == [["o-0", "o-1"], ["o-2", "o-3"]]


def test_redelivered_and_malformed_messages_run_alone_and_are_counted_at_their_start(
        sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    index = Index()
    a, b, c = envelope("o-a"), envelope("o-b"), envelope("o-c")
    items = [item(a), item(b, redelivered=True), BatchItem(body="{not json"), item(c), item(a)]
    results = deliver_batch(sessions, spec_of(index), items, tables=tables, settings=Settings(), clock=clock)
    # The fresh ones made one batch (a's second copy absorbed); b (its worker died mid-batch) ran alone,
    # counted for both its deliveries; the malformed body is a failure of its own, counted
    assert [(r.outcome, r.deliveries) for r in results] == [
        (Outcome.PROCESSED, 1), (Outcome.PROCESSED, 2), (Outcome.RETRY, 1), (Outcome.PROCESSED, 1),
        (Outcome.DUPLICATE, 1)]
    assert index.calls == [["o-a", "o-c"], ["o-b"]]
    assert effects(sessions) == {"o-a": 1, "o-b": 1, "o-c": 1}
    assert rows(sessions, tables.attempts) == 1  # the malformed one's count, until it is dead-lettered


def test_a_batch_redelivered_after_its_commit_is_all_duplicates(
        sessions: sessionmaker[Session], clock: ManualClock, tables: Tables) -> None:
    """A worker killed between the batch's commit and its acks: every message comes back, flagged."""
    index = Index()
    batch = [envelope(f"o-{i}") for i in range(3)]
    deliver_batch(sessions, spec_of(index), [item(e) for e in batch], tables=tables, settings=Settings(), clock=clock)
    again = deliver_batch(sessions, spec_of(index), [item(e, redelivered=True) for e in batch], tables=tables,
                          settings=Settings(), clock=clock)
    assert [r.outcome for r in again] == [Outcome.DUPLICATE] * 3
    assert effects(sessions) == {f"o-{i}": 1 for i in range(3)} and rows(sessions, tables.attempts) == 0


def test_concurrent_batches_with_overlapping_keys_process_each_message_once(
        pg_sessions: sessionmaker[Session], tables: Tables) -> None:
    """Postgres: two workers take overlapping batches in opposite orders; the sorted claim makes one wait
    for the other (never a deadlock), and each message has its effect once."""
    engine = pg_sessions.kw["bind"]
    DOCS.create(engine, checkfirst=True)
    try:
        batch = [envelope(f"o-{i}") for i in range(40)]
        spec = spec_of(Index())
        outcomes: list[list[Outcome]] = []
        errors: list[BaseException] = []

        def worker(envs: list[Envelope]) -> None:
            try:
                res = deliver_batch(pg_sessions, spec, [item(e) for e in envs], tables=tables, settings=Settings(),
                                    clock=ManualClock())
                outcomes.append([r.outcome for r in res])
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(batch[:30],)),
                   threading.Thread(target=worker, args=(list(reversed(batch[10:])),))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert errors == []
        assert effects(pg_sessions) == {f"o-{i}": 1 for i in range(40)}
        flat = [o for res in outcomes for o in res]
        assert (flat.count(Outcome.PROCESSED), flat.count(Outcome.DUPLICATE)) == (40, 20)
    finally:
        DOCS.drop(engine, checkfirst=True)


def test_each_message_of_a_batch_has_its_consumer_span_in_its_own_trace(
        sqlite_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry import propagate
    from opentelemetry import trace as otel_trace

    from tests.support.tracing import memory_tracer

    engine = sqlite_sessions.kw["bind"]
    DOCS.create(engine, checkfirst=True)
    with memory_tracer(monkeypatch) as exporter:
        batch = []
        for i in range(3):  # each message carries the trace of the transaction that published it
            with otel_trace.get_tracer("test").start_as_current_span(f"order-{i}"):
                headers: dict[str, Any] = {}
                propagate.inject(headers)
            batch.append(Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload={"order_id": f"o-{i}"},
                                  headers=headers))
        results = deliver_batch(sqlite_sessions, spec_of(Index()), [item(e) for e in batch], tables=tables,
                                settings=Settings(), clock=clock)
        assert [r.outcome for r in results] == [Outcome.PROCESSED] * 3
        spans = exporter.get_finished_spans()
    parents = {s.name: s.context.trace_id for s in spans if s.name.startswith("order-")}
    consumers = [s for s in spans if s.kind == otel_trace.SpanKind.CONSUMER]
    got = sorted((s.context.trace_id, dict(s.attributes or {})["messaging.message.id"],
                  dict(s.attributes or {})["outbox.outcome"]) for s in consumers)
    assert got == sorted((parents[f"order-{i}"], str(batch[i].message_id), "processed") for i in range(3))
