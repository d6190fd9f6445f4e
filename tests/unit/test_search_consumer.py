"""The reference deployment's search consumer: a batch consumer whose one upsert per batch is guarded by
the event's version, so versions arriving in any order, in one batch or across batches, leave the newest
document (consumers/search.py)."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.clock import ManualClock
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from consumers.models import SearchDocument
from consumers.search import search, search_in_order
from consumers.testing import order_placed_envelope


def v(order_id: str, n: int) -> Envelope:
    return order_placed_envelope(order_id, version=n, total_cents=n * 100)


def documents(sessions: sessionmaker[Session]) -> dict[str, tuple[int, int]]:
    with sessions() as s:
        return {d.order_id: (d.version, d.body["total_cents"]) for d in s.query(SearchDocument)}


def test_search_is_a_batch_consumer_and_its_ordered_twin_is_not() -> None:
    assert search.name == search_in_order.name == "search"
    assert search.batch_size is not None and not search.ordering
    assert search_in_order.ordering and search_in_order.batch_size is None


def test_versions_in_any_order_leave_the_newest_document(any_sessions: sessionmaker[Session], clock: ManualClock,
                                                         tables: Tables) -> None:
    # Given one batch with versions of o-1 out of order (3 before 2) and o-2's version 1
    with any_sessions() as s:
        outcomes = search.handle_batch(s, [v("o-1", 1), v("o-1", 3), v("o-2", 1), v("o-1", 2)], tables=tables,
                                       clock=clock)
    # Then every message is processed, and each order's document is its newest version in the batch
    assert outcomes == [Outcome.PROCESSED] * 4
    assert documents(any_sessions) == {"o-1": (3, 300), "o-2": (1, 100)}
    # When a later batch brings an older version of o-1 and a newer one of o-2
    with any_sessions() as s:
        assert search.handle_batch(s, [v("o-1", 2), v("o-2", 4)], tables=tables, clock=clock) == [Outcome.PROCESSED] * 2
    # Then the older one leaves o-1's newer document alone and the newer one replaces o-2's
    assert documents(any_sessions) == {"o-1": (3, 300), "o-2": (4, 400)}
    # And a message alone (a retry's path: the handler on a list of one) is guarded the same way
    with any_sessions() as s:
        assert search.handle(s, v("o-2", 3), tables=tables, clock=clock) is Outcome.PROCESSED
    assert documents(any_sessions) == {"o-1": (3, 300), "o-2": (4, 400)}
