"""One view over both dead-letter stores: ids, listing, replay, purge; bad input changes nothing."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.errors import NotFoundError, ValidationError
from celery_outbox.ops import dead_letters as dl
from celery_outbox.schema import Tables
from tests.ops_seed import T0, consumer_dead_letter, envelope, outbox_row

CONSUMERS = ("shipping", "billing", "search", "email")


class Sent:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, consumer: str, env: dict[str, Any]) -> None:
        self.calls.append((consumer, env))


def snapshot(s: Session, tables: Tables) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    s.expire_all()
    ob, cdl = tables.outbox, tables.dead_letters
    o = s.execute(sa.select(ob.seq, ob.dead_lettered_at_ms, ob.attempts, ob.next_attempt_at_ms).order_by(ob.seq)).all()
    c = s.execute(sa.select(cdl.id, cdl.replayed_at_ms).order_by(cdl.id)).all()
    return [tuple(r) for r in o], [tuple(r) for r in c]


@pytest.mark.parametrize("raw", ["42", "outbox:", "outbox:x", "outbox:0", "relay:1", "consumer:-1", ""])
def test_bad_ids_are_refused(raw: str) -> None:
    with pytest.raises(ValidationError, match="not a dead-letter id"):
        dl.DeadLetterId.parse(raw)


def test_ids_round_trip() -> None:
    assert str(dl.DeadLetterId.parse("outbox:42")) == "outbox:42"
    with pytest.raises(ValidationError, match="not a dead-letter id"):  # blanks around an id: refused, not stripped
        dl.DeadLetterId.parse(" outbox:42 ")
    assert dl.DeadLetterId.parse("consumer:7") == dl.DeadLetterId(source="consumer", row_id=7)


def test_list_merges_both_sources_oldest_first(sqlite_session: Session, tables: Tables) -> None:
    # Given an outbox dead letter, two consumer dead letters and rows that are not dead
    dead = outbox_row(sqlite_session, tables=tables, dead_lettered_at_ms=T0 + 500, attempts=10, last_error="nacked")
    outbox_row(sqlite_session, tables=tables)  # pending
    outbox_row(sqlite_session, tables=tables, published_at_ms=T0)  # published
    c1 = consumer_dead_letter(sqlite_session, tables=tables, consumer="billing", failed_at_ms=T0 + 100)
    c2 = consumer_dead_letter(sqlite_session, tables=tables, consumer="shipping", failed_at_ms=T0 + 900)
    # When listing all, one source, one consumer
    everything = dl.list_dead_letters(sqlite_session, tables=tables)
    only_outbox = dl.list_dead_letters(sqlite_session, tables=tables, source="outbox")
    only_billing = dl.list_dead_letters(sqlite_session, tables=tables, consumer="billing", known_consumers=CONSUMERS)
    # Then ids name their store and the order is by death time
    assert [str(d.id) for d in everything] == [f"consumer:{c1}", f"outbox:{dead.seq}", f"consumer:{c2}"]
    assert [str(d.id) for d in only_outbox] == [f"outbox:{dead.seq}"]
    assert [str(d.id) for d in only_billing] == [f"consumer:{c1}"]
    assert everything[1].error == "nacked" and everything[1].attempts == 10
    assert everything[0].payload["order_id"] == "o-1"
    assert everything[0].to_dict(now_ms=T0 + 1100)["age_ms"] == 1000


def test_unknown_consumer_is_an_error_not_an_empty_list(sqlite_session: Session, tables: Tables) -> None:
    with pytest.raises(NotFoundError, match="unknown consumer 'shiping'"):
        dl.list_dead_letters(sqlite_session, tables=tables, consumer="shiping", known_consumers=CONSUMERS)
    with pytest.raises(ValidationError, match="source must be"):
        dl.list_dead_letters(sqlite_session, tables=tables, source="relay")  # type: ignore[arg-type]


def test_get_refuses_missing_and_live_rows(sqlite_session: Session, tables: Tables) -> None:
    pending = outbox_row(sqlite_session, tables=tables)
    with pytest.raises(NotFoundError, match="is not dead-lettered"):
        dl.get(sqlite_session, f"outbox:{pending.seq}", tables=tables)
    with pytest.raises(NotFoundError, match="does not exist"):
        dl.get(sqlite_session, "outbox:999", tables=tables)
    with pytest.raises(NotFoundError, match="no such consumer dead letter"):
        dl.get(sqlite_session, "consumer:999", tables=tables)


def test_outbox_replay_makes_the_row_due_now_with_fresh_attempts(sqlite_session: Session,
                                                                 clock: ManualClock, tables: Tables) -> None:
    # Given a row the relay gave up on long ago
    row = outbox_row(sqlite_session, tables=tables, dead_lettered_at_ms=T0, attempts=10, last_error="nacked")
    clock.set(T0 + 3_600_000)
    # When it is replayed
    (result,) = dl.replay(sqlite_session, [f"outbox:{row.seq}"], tables=tables, clock=clock)
    # Then it is pending again, due now, with a full attempt budget, and listed no more
    assert result.replayed
    assert snapshot(sqlite_session, tables)[0] == [(row.seq, None, 0, T0 + 3_600_000)]
    assert dl.list_dead_letters(sqlite_session, tables=tables) == []
    # And a second replay is a reported no-op, not a second change
    (again,) = dl.replay(sqlite_session, [f"outbox:{row.seq}"], tables=tables, clock=clock)
    assert not again.replayed and "already replayed" in again.detail


def test_consumer_replay_sends_once_and_marks(sqlite_session: Session, clock: ManualClock, tables: Tables) -> None:
    env = envelope("o-9")
    cid = consumer_dead_letter(sqlite_session, tables=tables, consumer="search", env=env)
    sent = Sent()
    (first,) = dl.replay(sqlite_session, [f"consumer:{cid}"], tables=tables, clock=clock, send=sent, known_consumers=CONSUMERS)
    (second,) = dl.replay(sqlite_session, [f"consumer:{cid}"], tables=tables, clock=clock, send=sent, known_consumers=CONSUMERS)
    assert first.replayed and not second.replayed
    assert sent.calls == [("search", env)]
    assert snapshot(sqlite_session, tables)[1] == [(cid, clock.now_ms())]


def test_one_bad_id_in_a_batch_changes_nothing(sqlite_session: Session, clock: ManualClock, tables: Tables) -> None:
    # Given two real dead letters
    row = outbox_row(sqlite_session, tables=tables, dead_lettered_at_ms=T0, attempts=10)
    cid = consumer_dead_letter(sqlite_session, tables=tables)
    before = snapshot(sqlite_session, tables)
    sent = Sent()
    # When a batch names them plus one that does not exist
    with pytest.raises(NotFoundError, match="consumer:404"):
        dl.replay(sqlite_session, [f"outbox:{row.seq}", f"consumer:{cid}", "consumer:404"], tables=tables, clock=clock, send=sent)
    with pytest.raises(NotFoundError, match="outbox:404"):
        dl.purge(sqlite_session, [f"outbox:{row.seq}", "outbox:404"], tables=tables)
    # Then nothing was sent, replayed or deleted
    assert sent.calls == []
    assert snapshot(sqlite_session, tables) == before


def test_unreplayable_consumer_row_refuses_the_whole_batch(sqlite_session: Session, clock: ManualClock, tables: Tables) -> None:
    row = outbox_row(sqlite_session, tables=tables, dead_lettered_at_ms=T0, attempts=10)
    poison = consumer_dead_letter(sqlite_session, tables=tables, body="not json at all")
    gone = consumer_dead_letter(sqlite_session, tables=tables, consumer="retired")
    before = snapshot(sqlite_session, tables)
    sent = Sent()
    with pytest.raises(ValidationError, match="cannot be replayed"):
        dl.replay(sqlite_session, [f"outbox:{row.seq}", f"consumer:{poison}"], tables=tables, clock=clock, send=sent)
    with pytest.raises(ValidationError, match="unknown consumer 'retired'"):
        dl.replay(sqlite_session, [f"outbox:{row.seq}", f"consumer:{gone}"], tables=tables, clock=clock, send=sent,
                  known_consumers=CONSUMERS)
    assert sent.calls == [] and snapshot(sqlite_session, tables) == before
    # The malformed body is still shown raw, never lost
    assert dl.get(sqlite_session, f"consumer:{poison}", tables=tables).payload == "not json at all"


def test_replay_all_for_one_consumer(sqlite_session: Session, clock: ManualClock, tables: Tables) -> None:
    outbox_row(sqlite_session, tables=tables, dead_lettered_at_ms=T0, attempts=10)
    a = consumer_dead_letter(sqlite_session, tables=tables, consumer="email")
    consumer_dead_letter(sqlite_session, tables=tables, consumer="billing")
    sent = Sent()
    results = dl.replay_all(sqlite_session, tables=tables, clock=clock, send=sent, consumer="email", known_consumers=CONSUMERS)
    assert [str(r.id) for r in results] == [f"consumer:{a}"]
    assert [c for c, _ in sent.calls] == ["email"]
    assert {d.source for d in dl.list_dead_letters(sqlite_session, tables=tables)} == {"outbox", "consumer"}


def test_purge_deletes_dead_letters_and_refuses_live_rows(sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    with sqlite_sessions() as s:
        dead = outbox_row(s, tables=tables, dead_lettered_at_ms=T0, attempts=10)
        live = outbox_row(s, tables=tables)
        cid = consumer_dead_letter(s, tables=tables)
        with pytest.raises(ValidationError, match=f"outbox:{live.seq}: not dead-lettered"):
            dl.purge(s, [f"outbox:{dead.seq}", f"outbox:{live.seq}"], tables=tables)
        assert len(dl.list_dead_letters(s, tables=tables)) == 2
        assert dl.purge(s, [f"outbox:{dead.seq}", f"consumer:{cid}", f"consumer:{cid}"], tables=tables) == 2
    with sqlite_sessions() as s:
        assert dl.list_dead_letters(s, tables=tables) == []
        assert s.scalar(sa.select(sa.func.count()).select_from(tables.outbox)) == 1  # the live row stays
