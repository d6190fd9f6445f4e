"""The Celery side (rule 7) without a broker: tasks applied eagerly, retries included.

Returning = ack, raising = retry with backoff, deliveries counted in the database, dead letter after
``consumer_max_deliveries``; malformed input takes the same bounded road and never loops.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery, states
from sqlalchemy.orm import Session, sessionmaker

import consumers
from celery_outbox.celery.consumer_tasks import DeadLettered
from celery_outbox.clock import ManualClock
from celery_outbox.consumer import ConsumerRegistry, ConsumerSpec, consumer
from celery_outbox.db import make_session_factory
from celery_outbox.delivery import deliver, delivery_key
from celery_outbox.errors import ConfigError
from celery_outbox.inbox import dead_letters
from celery_outbox.messages import Envelope, task_id, task_name
from celery_outbox.outbox import Outbox
from celery_outbox.policy import Backoff
from celery_outbox.schema import Tables
from celeryconfig import Settings, celery_config
from consumers.billing import billing
from consumers.effects import effect_counts
from consumers.email import email
from consumers.models import Shipment
from consumers.search import search
from consumers.shipping import shipping
from consumers.testing import order_placed_envelope


def deployment_consumers() -> ConsumerRegistry:
    """The four example consumers of the reference deployment (``consumers/``), e-mail included."""
    return ConsumerRegistry(specs=[shipping, billing, search, email])


def make_outbox(settings: Settings, clock: ManualClock, sessions: sessionmaker[Session], tables: Tables,
                specs: Iterable[ConsumerSpec] | None = None) -> Outbox:
    """An Outbox on the test's database with the deployment's consumers, or only ``specs`` (routed as they declare)."""
    app = Celery("test-consumers", set_as_current=False)
    app.conf.update(celery_config(settings, "memory://"))
    box = Outbox(app, settings=settings if specs is None else settings.replace(routes={}), session_factory=sessions,
                 clock=clock)
    box._tables = tables  # one mapping of the default prefix for the whole test session
    if specs is None:
        consumers.register(box)
    else:
        for spec in specs:
            box.include(spec)
    return box


def with_a_broken_shipping(settings: Settings, clock: ManualClock, sessions: sessionmaker[Session],
                           tables: Tables) -> tuple[Outbox, dict[str, bool]]:
    """An outbox whose only consumer, shipping, raises "carrier down" while ``broken["on"]`` is set."""
    broken = {"on": True}

    @consumer(name="shipping", event="OrderPlaced")
    def sometimes(session: Session, env: Envelope) -> None:
        if broken["on"]:
            raise RuntimeError("carrier down")
        shipping(session, env)

    return make_outbox(settings, clock, sessions, tables, [sometimes]), broken


def apply(app: Celery, name: str, body: Any) -> Any:
    """The task's result; a dead letter (the task rejects its message, never requeued) as "dead_lettered"."""
    result = app.tasks[task_name(name)].apply(args=[body], task_id=task_id())
    if result.state == states.REJECTED:
        assert isinstance(result.result, DeadLettered) and result.result.requeue is False, result.result
        return "dead_lettered"
    return result.get(disable_sync_subtasks=False)


def dup(body: dict[str, Any]) -> str:
    return f"duplicate of {body['message_id']}"


def rows(sessions: sessionmaker[Session], model: type) -> list[Any]:
    with sessions() as s:
        return list(s.execute(sa.select(model)).scalars().all())


def test_register_defines_one_task_per_configured_consumer(settings: Settings, clock: ManualClock,
                                                            sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    app = make_outbox(settings, clock, sqlite_sessions, tables, [shipping, billing]).app
    names = sorted(n for n in app.tasks if n.startswith("consumers."))
    assert names == ["consumers.billing", "consumers.shipping"]  # one task per declared consumer
    task = app.tasks["consumers.shipping"]
    assert task.acks_late and task.reject_on_worker_lost and task.ignore_result
    route = app.amqp.router.route({}, "consumers.shipping")
    assert route["queue"].name == f"{settings.namespace}.shipping"
    # A route to a consumer nobody declares has no task to run it: refused, not silently skipped
    box = Outbox(Celery("nobody", set_as_current=False),
                 settings=settings.replace(routes={"OrderPlaced": ("shipping", "billing", "nobody")}),
                 session_factory=sqlite_sessions, clock=clock)
    box.include(shipping)
    box.include(billing)
    with pytest.raises(ConfigError, match="'nobody'"):
        box.routes()


def test_good_message_processed_and_acked(settings: Settings, clock: ManualClock,
                                          sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # The four example consumers (the e-mail one with its ``prepare`` step), whatever the deployment registers
    app = make_outbox(settings, clock, sqlite_sessions, tables, deployment_consumers()).app
    body = order_placed_envelope("o-1").to_dict()
    assert [apply(app, n, body) for n in ("shipping", "billing", "search", "email")] == ["processed"] * 4
    assert apply(app, "shipping", body) == dup(body)
    with sqlite_sessions() as s:
        assert effect_counts(s) == {"shipping": 1, "billing": 1, "search": 1, "email": 1}
    assert rows(sqlite_sessions, tables.attempts) == []  # the count is dropped once handled


def test_poison_not_json_dead_lettered_after_three_deliveries_good_one_flows(
        settings: Settings, clock: ManualClock, sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a message whose payload is "not json", and a good one behind it
    app = make_outbox(settings.replace(consumer_max_deliveries=3), clock, sqlite_sessions, tables).app
    poison = {"message_id": str(uuid.uuid4()), "type": "OrderPlaced", "payload": "not json", "headers": {}}
    good = order_placed_envelope("o-2").to_dict()
    # When the poison is delivered: it is retried, then dead-lettered and acked
    assert apply(app, "shipping", poison) == "dead_lettered"
    # Then it is in the dead-letter store with delivery count 3, raw body kept
    [dl] = rows(sqlite_sessions, tables.dead_letters)
    assert (dl.consumer, dl.message_id, dl.delivery_count) == ("shipping", poison["message_id"], 3)
    assert "MalformedMessageError: payload is not JSON" in dl.last_error
    assert json.loads(dl.body) == poison
    assert dl.first_failed_at_ms <= dl.last_failed_at_ms
    # And the good message behind it is processed
    assert apply(app, "shipping", good) == "processed"
    assert [s.order_id for s in rows(sqlite_sessions, Shipment)] == ["o-2"]
    # And a redelivery of the dead-lettered poison (crash before its ack) adds no second dead letter
    assert apply(app, "shipping", poison) == "dead_lettered"
    assert len(rows(sqlite_sessions, tables.dead_letters)) == 1


def test_transient_failure_redelivered_once_then_processed_once(settings: Settings, clock: ManualClock,
                                                                sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a shipping consumer whose downstream fails once
    calls: list[str] = []

    @consumer(name="shipping", event="OrderPlaced")
    def flaky(session: Session, env: Envelope) -> None:
        calls.append(str(env.message_id))
        if len(calls) == 1:
            raise ConnectionError("carrier API timed out")
        shipping(session, env)

    app = make_outbox(settings, clock, sqlite_sessions, tables, [flaky]).app
    body = order_placed_envelope("o-1").to_dict()
    # When delivered, Then it is redelivered once and processed once
    assert apply(app, "shipping", body) == "processed"
    assert len(calls) == 2
    assert len(rows(sqlite_sessions, Shipment)) == 1
    assert len(rows(sqlite_sessions, tables.inbox)) == 1
    assert rows(sqlite_sessions, tables.dead_letters) == []
    assert rows(sqlite_sessions, tables.attempts) == []


BAD_BODIES = {
    "payload not json": ({"message_id": str(uuid.uuid4()), "type": "OrderPlaced", "payload": "not json"},
                         "payload is not JSON"),
    "missing fields": ({"message_id": str(uuid.uuid4()), "type": "OrderPlaced"}, "missing field(s): payload"),
    "missing payload field": ({"message_id": str(uuid.uuid4()), "type": "OrderPlaced", "payload": {"x": 1}},
                              "missing required field"),
    "unknown event type": ({"message_id": str(uuid.uuid4()), "type": "OrderShipped", "payload": {}},
                           "does not handle event type 'OrderShipped'"),
    "not an object": ("{{{ definitely not json", "envelope is not JSON"),
    "no message id": ({"type": "OrderPlaced", "payload": {}}, "missing field(s): message_id"),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_malformed_input_never_loops(case: str, settings: Settings, clock: ManualClock,
                                     sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    body, error = BAD_BODIES[case]
    app = make_outbox(settings, clock, sqlite_sessions, tables).app
    assert apply(app, "billing", body) == "dead_lettered"
    [dl] = rows(sqlite_sessions, tables.dead_letters)
    assert dl.delivery_count == settings.consumer_max_deliveries
    assert error in dl.last_error
    assert dl.body == (body if isinstance(body, str) else json.dumps(body, separators=(",", ":"), sort_keys=True))
    assert rows(sqlite_sessions, tables.inbox) == []


def test_message_over_the_size_limit_is_dead_lettered(settings: Settings, clock: ManualClock,
                                                      sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    app = make_outbox(settings.replace(max_message_bytes=2_000), clock, sqlite_sessions, tables).app
    body = order_placed_envelope("o-1", note="x" * 5_000).to_dict()
    assert apply(app, "shipping", body) == "dead_lettered"
    [dl] = rows(sqlite_sessions, tables.dead_letters)
    assert "MessageTooLargeError" in dl.last_error and "over the limit of 2000 bytes" in dl.last_error
    assert "x" * 5_000 in dl.body  # nothing lost
    assert rows(sqlite_sessions, Shipment) == []


def test_deliveries_lost_with_a_killed_worker_count_too(settings: Settings, clock: ManualClock,
                                                        sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a message whose three deliveries each died with the worker (counted at their start only)
    env = order_placed_envelope("o-1")
    spec = shipping
    for _ in range(3):
        with sqlite_sessions() as s:
            from celery_outbox.inbox import attempts

            attempts.begin(s, tables=tables, key=env.message_id, consumer="shipping", now_ms=clock.now_ms())
    # When the broker delivers it a fourth time
    result = deliver(sqlite_sessions, spec, env.to_dict(), tables=tables, request_id=None, settings=settings, clock=clock)
    # Then it is dead-lettered (not processed), delivery count 3, saying the worker was lost
    assert result.outcome.value == "dead_lettered"
    [dl] = rows(sqlite_sessions, tables.dead_letters)
    assert dl.delivery_count == 3 and "worker was lost" in dl.last_error
    assert rows(sqlite_sessions, Shipment) == []


def test_database_down_is_retried_and_not_counted(settings: Settings, clock: ManualClock, tmp_path: Any, tables: Tables) -> None:
    # Given a database that cannot be opened (its path is a directory)
    (tmp_path / "db-is-a-dir").mkdir()
    broken = make_session_factory(sa.create_engine(f"sqlite:///{tmp_path / 'db-is-a-dir'}"))
    result = deliver(broken, shipping, order_placed_envelope().to_dict(), tables=tables, request_id=None,
                     settings=settings, clock=clock)
    # Then the delivery asks for a retry, charged to nobody
    assert result.outcome.value == "retry" and result.deliveries == 0 and result.retry_in_s is not None


def test_fast_path_disabled_tasks_still_idempotent(settings: Settings, clock: ManualClock,
                                                   sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    app = make_outbox(settings, clock, sqlite_sessions, tables, deployment_consumers().with_options(fast_path=False)).app
    body = order_placed_envelope("o-1").to_dict()
    assert [apply(app, "shipping", body) for _ in range(3)] == ["processed", dup(body), dup(body)]
    assert len(rows(sqlite_sessions, Shipment)) == 1


def test_retry_backoff_and_delivery_key() -> None:
    policy = Backoff(max_deliveries=3, base_s=1, max_s=5)
    assert [policy.delay_s(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    mid = uuid.uuid4()
    assert delivery_key({"message_id": str(mid)}, "x", "") == mid
    tid = str(uuid.uuid4())
    assert delivery_key({"message_id": "nope"}, tid, "") == uuid.UUID(tid)
    assert delivery_key("raw", None, "raw") == delivery_key("raw", None, "raw")


def test_replayed_dead_letter_processed_through_the_inbox(settings: Settings, clock: ManualClock,
                                                          sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a message dead-lettered while its consumer was broken
    box, broken = with_a_broken_shipping(settings, clock, sqlite_sessions, tables)
    app = box.app
    body = order_placed_envelope("o-1").to_dict()
    assert apply(app, "shipping", body) == "dead_lettered"
    [dl] = rows(sqlite_sessions, tables.dead_letters)
    # When the consumer is fixed and a person replays it (twice, by mistake)
    broken["on"] = False
    outcomes: list[Any] = []
    with sqlite_sessions() as s:
        for _ in range(2):
            dead_letters.replay(s, dl.id, tables=tables, send=lambda c, e: outcomes.append(apply(app, c, e)), clock=clock,
                                known_consumers=settings.consumers)
    # Then it is processed once; the second replay is a duplicate the inbox absorbed
    assert outcomes == ["processed", dup(body)]
    assert len(rows(sqlite_sessions, Shipment)) == 1
    [after] = rows(sqlite_sessions, tables.dead_letters)
    assert after.replayed_at_ms == clock.now_ms()


def test_processed_then_lost_worker_repeatedly_is_still_a_duplicate(settings: Settings, clock: ManualClock,
                                                                    sqlite_sessions: sessionmaker[Session],
                                                                    tables: Tables) -> None:
    # Given a message processed, whose worker then died before the ack (and before clearing its count)
    env = order_placed_envelope("o-1")
    spec = shipping
    with sqlite_sessions() as s:
        assert spec.handle(s, env, tables=tables, clock=clock).value == "processed"
        from celery_outbox.inbox import attempts

        for _ in range(3):
            attempts.begin(s, tables=tables, key=env.message_id, consumer="shipping", now_ms=clock.now_ms())
    # When it is redelivered past the delivery limit
    result = deliver(sqlite_sessions, spec, env.to_dict(), tables=tables, request_id=None, settings=settings, clock=clock)
    # Then it is a duplicate, not a dead letter
    assert result.outcome.value == "duplicate"
    assert rows(sqlite_sessions, tables.dead_letters) == []
    assert rows(sqlite_sessions, tables.attempts) == []
    assert len(rows(sqlite_sessions, Shipment)) == 1


def test_duplicates_and_dead_letters_are_announced_as_celery_events(settings: Settings, clock: ManualClock,
                                                                     sqlite_sessions: sessionmaker[Session],
                                                                     monkeypatch: pytest.MonkeyPatch, tables: Tables) -> None:
    # Given a consumer app whose Celery event dispatcher is recorded (Flower reads these events)
    sent: list[tuple[str, dict[str, Any]]] = []
    from celery_outbox.celery import events

    def record(app: Any, type: str, **fields: Any) -> bool:
        sent.append((type, fields))
        return True

    monkeypatch.setattr(events, "send_event", record)
    app = make_outbox(settings.replace(consumer_max_deliveries=1), clock, sqlite_sessions, tables).app
    body = order_placed_envelope("o-ev").to_dict()
    # When a message is processed, then delivered again, and a poison message fails its only delivery
    apply(app, "shipping", body)
    apply(app, "shipping", body)
    poison = {**body, "message_id": str(uuid.uuid4()), "payload": "not json"}
    apply(app, "shipping", poison)
    # Then exactly one duplicate-absorbed and one dead-lettered event were sent, with their message ids
    assert [t for t, _ in sent] == [events.DUPLICATE_ABSORBED, events.DEAD_LETTERED]
    assert sent[0][1]["message_id"] == body["message_id"] and sent[0][1]["consumer"] == "shipping"
    assert sent[1][1]["message_id"] == poison["message_id"] and "not JSON" in sent[1][1]["error"]


def test_first_delivery_costs_no_bookkeeping(settings: Settings, clock: ManualClock,
                                             sqlite_sessions: sessionmaker[Session], sqlite_engine: sa.Engine,
                                             tables: Tables) -> None:
    # Given a fresh message (no retry, no broker redelivery)
    statements: list[str] = []
    sa.event.listen(sqlite_engine, "before_cursor_execute",
                    lambda _c, _cur, stmt, *_a: statements.append(stmt.split()[0] + " " + stmt))
    env = order_placed_envelope("o-fast")
    # When it is delivered and succeeds
    result = deliver(sqlite_sessions, shipping, env.to_dict(), tables=tables, request_id=None,
                     settings=settings, clock=clock, first_delivery=True)
    # Then it is processed and the delivery counter table was never touched (one commit: the effect's)
    assert result.outcome.value == "processed"
    assert not [s for s in statements if tables.table(tables.attempts).name in s]
    assert len(rows(sqlite_sessions, Shipment)) == 1


def test_a_redelivered_first_delivery_counts_the_lost_one_too(settings: Settings, clock: ManualClock,
                                                               sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a message whose first delivery died with its worker before anything was counted
    @consumer(name="shipping", event="OrderPlaced")
    def failing(session: Session, env: Envelope) -> None:
        raise RuntimeError("carrier down")

    env = order_placed_envelope("o-lost")
    # When the broker redelivers it (redelivered flag) and it fails again
    result = deliver(sqlite_sessions, failing, env.to_dict(), tables=tables, request_id=None, settings=settings, clock=clock,
                     first_delivery=True, redelivered=True)
    # Then both deliveries are counted, so a worker-killing message is still bounded by max deliveries
    assert result.outcome.value == "retry" and result.deliveries == 2
    [row] = rows(sqlite_sessions, tables.attempts)
    assert row.deliveries == 2 and "carrier down" in row.last_error


def test_a_failing_first_delivery_is_counted_once_and_not_run_twice(settings: Settings, clock: ManualClock,
                                                                     sqlite_sessions: sessionmaker[Session],
                                                                    tables: Tables) -> None:
    calls: list[str] = []

    @consumer(name="shipping", event="OrderPlaced")
    def failing(session: Session, env: Envelope) -> None:
        calls.append(env.payload["order_id"])
        raise RuntimeError("carrier down")

    result = deliver(sqlite_sessions, failing, order_placed_envelope("o-f").to_dict(), tables=tables, request_id=None,
                     settings=settings, clock=clock, first_delivery=True)
    assert result.outcome.value == "retry" and result.deliveries == 1 and calls == ["o-f"]


def test_a_replay_runs_under_the_dead_lettered_task_id_and_the_inbox_still_guards_it(
        settings: Settings, clock: ManualClock, sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    from celery_outbox.celery.sender import replay_sender
    from celery_outbox.ops import dead_letters as ops_dead_letters

    # Given a message dead-lettered under task id T while its consumer was broken
    box, broken = with_a_broken_shipping(settings, clock, sqlite_sessions, tables)
    app = box.app
    body = order_placed_envelope("o-tid").to_dict()
    original = task_id()
    failed = app.tasks[task_name("shipping")].apply(args=[body], task_id=original)
    assert failed.state == states.REJECTED
    [dl] = rows(sqlite_sessions, tables.dead_letters)
    # Then the dead letter keeps T, and the FAILURE's reason (what Flower shows) names the dead letter and its group
    assert dl.task_id == original
    assert str(failed.result).startswith(
        f"dead-lettered for shipping after {settings.consumer_max_deliveries} deliveries "
        f"as consumer:{dl.id} (group {dl.fingerprint}): RuntimeError: carrier down"), failed.result
    # When the consumer is fixed and a person replays it twice (by mistake), through the real sender
    broken["on"] = False
    sent: list[dict[str, Any]] = []
    outcomes: list[Any] = []

    def run_now(name: str, **kw: Any) -> None:  # the broker, as an eager worker: run it under the id it was sent with
        sent.append(kw)
        outcomes.append(app.tasks[name].apply(args=kw["args"], task_id=kw["task_id"]).get(disable_sync_subtasks=False))

    app.send_task = run_now  # type: ignore[method-assign,assignment]
    send = replay_sender(app, box)
    with sqlite_sessions() as s:
        [result] = ops_dead_letters.replay(s, [f"consumer:{dl.id}"], tables=tables, clock=clock, send=send,
                                           known_consumers=box.known_consumers())
        assert result.replayed and original in result.detail
        s.execute(sa.update(tables.dead_letters).values(replayed_at_ms=None))  # a second replay, by mistake
        s.commit()
        ops_dead_letters.replay(s, [f"consumer:{dl.id}"], tables=tables, clock=clock, send=send)
        shown = ops_dead_letters.get(s, f"consumer:{dl.id}", tables=tables).to_dict(now_ms=clock.now_ms())
    # Then both went out under T, the message was processed once and the second absorbed by the inbox
    assert [kw["task_id"] for kw in sent] == [original, original]
    assert outcomes == ["processed", dup(body)]
    assert len(rows(sqlite_sessions, Shipment)) == 1
    # And 'outbox dead-letters show --json' names the task id
    assert shown["task_id"] == original


def test_a_dead_letter_without_a_task_id_is_replayed_as_a_new_task(
        settings: Settings, clock: ManualClock, sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    from celery_outbox.celery.sender import replay_sender

    # Given a dead letter that kept no task id (written before the column existed), and one whose id was too long
    body = order_placed_envelope("o-old").to_dict()
    with sqlite_sessions() as s:
        ids = [dead_letters.record(s, tables=tables, consumer="shipping", message_id=body["message_id"],
                                   type="OrderPlaced", body=json.dumps(body), headers={}, delivery_count=3,
                                   last_error="E: boom", first_failed_at_ms=1, last_failed_at_ms=2, task_id=tid).id
               for tid in (None, "x" * 65)]
        s.commit()
    box = make_outbox(settings, clock, sqlite_sessions, tables)
    calls: list[dict[str, Any]] = []
    box.app.send_task = lambda name, **kw: calls.append(kw)  # type: ignore[method-assign]
    # When both are replayed
    with sqlite_sessions() as s:
        assert [dead_letters.get(s, i, tables=tables).task_id for i in ids] == [None, None]
        for i in ids:
            dead_letters.replay(s, i, tables=tables, send=replay_sender(box.app, box), clock=clock)
    # Then each went out as a task of its own (a fresh UUID)
    assert len({str(uuid.UUID(kw["task_id"])) for kw in calls}) == 2
