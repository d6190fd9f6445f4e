"""``outbox trace``: one message's story from the tables, on SQLite and Postgres, library and CLI."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.cli import cli
from celery_outbox.errors import NotFoundError, ValidationError
from celery_outbox.inbox.task_keys import task_key
from celery_outbox.ops import trace as ops_trace
from tests.ops_seed import T0, consumer_dead_letter, order_payload

ROUTES = {"OrderPlaced": ("billing", "email", "search", "shipping")}
TASK = "orders.send_confirmation_email"


def order_42(s: Session, tables: Tables) -> dict[str, uuid.UUID]:
    """Given order 42's OrderPlaced: published after 40 ms; shipping processed it 60 ms later; billing
    dead-lettered it, it was replayed and billing is failing again; e-mail never saw it; search parked it.
    Its confirmation e-mail task ran (inbox row under the task key); a second event for the order is
    still pending after two failed publishes."""
    event, task, later = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    s.add_all([
        tables.outbox(message_id=event, type="OrderPlaced", payload=order_payload("42"),
                      headers={"correlation_id": "req-42", "entity_key": "order:42", "entity_version": 1},
                      created_at_ms=T0, published_at_ms=T0 + 40, attempts=0, next_attempt_at_ms=T0),
        tables.outbox(message_id=task, type=TASK, payload={"body": [["42"], {}, None]},
                      headers={"outbox_kind": "task", "correlation_id": "req-42",
                               "task_headers": {"task": TASK, "id": str(task)}},
                      created_at_ms=T0, published_at_ms=T0 + 45, attempts=0, next_attempt_at_ms=T0),
        tables.outbox(message_id=later, type="OrderPlaced", payload=order_payload("42"),
                      headers={"correlation_id": "req-43", "entity_key": "order:42", "entity_version": 2},
                      created_at_ms=T0 + 1000, attempts=2, next_attempt_at_ms=T0 + 9000,
                      last_error="broker nacked the message"),
        tables.inbox(message_id=event, consumer="shipping", type="OrderPlaced", processed_at_ms=T0 + 100),
        tables.inbox(message_id=task, consumer=task_key(TASK), type=TASK, processed_at_ms=T0 + 300),
        tables.attempts(message_id=event, consumer="billing", deliveries=1, first_failed_at_ms=T0 + 5000,
                        last_failed_at_ms=T0 + 5000, last_error="RuntimeError: ledger locked"),
        tables.parked(message_id=event, consumer="search", entity_key="order:42", entity_version=1,
                      envelope={}, parked_at_ms=T0 + 90),
    ])
    s.commit()
    env = {"message_id": str(event), "type": "OrderPlaced", "payload": order_payload("42"), "headers": {},
           "created_at_ms": T0}
    dl = consumer_dead_letter(s, tables=tables, consumer="billing", env=env, failed_at_ms=T0 + 2000,
                              error="RuntimeError: ledger down")
    row = s.get(tables.dead_letters, dl)
    assert row is not None
    row.replayed_at_ms = T0 + 4000
    s.commit()
    return {"event": event, "task": task, "later": later}


def test_a_message_id_gives_every_hop(any_sessions: sessionmaker[Session], tables: Tables) -> None:
    with any_sessions() as s:
        ids = order_42(s, tables)
        [t] = ops_trace.trace(s, str(ids["event"]), tables=tables, routes=ROUTES, idempotent_tasks={TASK})
    assert (t.kind, t.state, t.entity_key, t.correlation_id) == ("event", "published", "order:42", "req-42")
    assert (t.created_at_ms, t.published_at_ms, t.publish_latency_ms) == (T0, T0 + 40, 40)
    hops = {h.name: h for h in t.hops}
    assert list(hops) == ["billing", "email", "search", "shipping"]
    assert (hops["shipping"].state, hops["shipping"].processed_at_ms, hops["shipping"].latency_ms) == \
        ("processed", T0 + 100, 60)
    billing = hops["billing"]
    assert (billing.state, billing.failed_deliveries, billing.last_error) == ("failing", 1, "RuntimeError: ledger locked")
    assert [(d.replayed_at_ms, d.error) for d in billing.dead_letters] == [(T0 + 4000, "RuntimeError: ledger down")]
    assert (hops["search"].state, hops["search"].parked_at_ms) == ("parked", T0 + 90)
    assert (hops["email"].state, hops["email"].processed_at_ms) == ("not seen yet", None)
    json.dumps(t.to_dict())


def test_an_entity_key_gives_each_message_of_the_order(any_sessions: sessionmaker[Session], tables: Tables) -> None:
    with any_sessions() as s:
        ids = order_42(s, tables)
        found = ops_trace.trace(s, "order:42", tables=tables, routes=ROUTES, idempotent_tasks={TASK})
        by_corr = ops_trace.trace(s, "req-42", tables=tables, routes=ROUTES, idempotent_tasks={TASK})
    assert [t.message_id for t in found] == [str(ids["event"]), str(ids["later"])]
    later = found[1]
    assert (later.state, later.publish_attempts_failed, later.next_attempt_at_ms, later.last_publish_error) == \
        ("retrying", 2, T0 + 9000, "broker nacked the message")
    assert all(h.state == "not seen yet" for h in later.hops)
    assert [t.message_id for t in by_corr] == [str(ids["event"]), str(ids["task"])]
    task = by_corr[1]
    assert task.kind == "task" and [(h.name, h.state, h.latency_ms) for h in task.hops] == \
        [(task_key(TASK), "processed", 255)]


def test_a_pruned_outbox_row_still_shows_its_inbox_rows(any_sessions: sessionmaker[Session], tables: Tables) -> None:
    with any_sessions() as s:
        ids = order_42(s, tables)
        s.delete(s.get(tables.outbox, s.query(tables.outbox.seq).filter_by(message_id=ids["event"]).scalar()))
        s.commit()
        [t] = ops_trace.trace(s, str(ids["event"]), tables=tables, routes=ROUTES)
    assert (t.state, t.kind) == ("pruned", "unknown")
    assert {h.name: h.state for h in t.hops} == {"shipping": "processed", "billing": "failing", "search": "parked"}


@pytest.mark.parametrize("key", ["", "   ", "x" * 201, "order:\x0042", "\u202eorder"])
def test_a_bad_key_is_refused(sqlite_session: Session, tables: Tables, key: str) -> None:
    with pytest.raises(ValidationError, match="not a message id or key"):
        ops_trace.trace(sqlite_session, key, tables=tables, routes=ROUTES)


def test_an_unknown_key_is_not_found(sqlite_session: Session, tables: Tables) -> None:
    with pytest.raises(NotFoundError):
        ops_trace.trace(sqlite_session, "order:nope", tables=tables, routes=ROUTES)
    with pytest.raises(NotFoundError):
        ops_trace.trace(sqlite_session, str(uuid.uuid4()), tables=tables, routes=ROUTES)


def run(env: dict[str, str], *args: str) -> Result:
    sys.modules.pop("relay.app", None)  # built from this env, as a new process would
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def test_cli_text_and_json(any_sessions: sessionmaker[Session], tables: Tables, any_db_url: str, tmp_home: Path,
                           namespace: str) -> None:
    with any_sessions() as s:
        ids = order_42(s, tables)
    env = {"OUTBOX_DATABASE_URL": any_db_url, "OUTBOX_HOME": str(tmp_home), "OUTBOX_NAMESPACE": namespace,
           "OUTBOX_BROKER_URL": "memory://"}
    r = run(env, "trace", "order:42", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [m["message_id"] for m in data] == [str(ids["event"]), str(ids["later"])]
    # the deployment routes OrderPlaced to billing, search and shipping (its e-mail is a task)
    assert {h["name"]: h["state"] for h in data[0]["hops"]} == {
        "billing": "failing", "search": "parked", "shipping": "processed"}
    r = run(env, "trace", str(ids["task"]))
    assert r.exit_code == 0, r.output
    assert task_key(TASK) in r.stdout and "processed" in r.stdout and "not recorded, so not shown" in r.stdout
    r = run(env, "trace", "order:404")
    assert r.exit_code == 1 and "no outbox message has id, entity_key or correlation_id 'order:404'" in r.output
    assert "Traceback" not in r.output
