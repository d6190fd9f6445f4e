"""Readers add a counter's stripes up (celery_outbox/counters.py), whichever database wrote them."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import ManualClock, Tables, counters
from celery_outbox.ops.stats import collect


def test_stats_and_value_add_a_counters_stripes_and_keep_other_names_apart(
        sqlite_sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> None:
    # Given a published counter kept in three rows (its own name and two stripes), and names that only look alike
    with sqlite_sessions() as s:
        for scope, name, value in ((counters.RELAY, counters.PUBLISHED, 40), (counters.RELAY, "published#731", 2),
                                   (counters.RELAY, "published#9001", 5), (counters.RELAY, "published#x", 100),
                                   ("shipping", "duplicates#12", 3), ("shipping", counters.PUBLISHED, 1)):
            s.add(tables.counters(consumer=scope, name=name, value=value))
        s.commit()
    # When they are read
    with sqlite_sessions() as s:
        st = collect(s, tables=tables, clock=clock)
        published = counters.value(s, counters.RELAY, counters.PUBLISHED, tables=tables)
        duplicates = counters.value(s, "shipping", "duplicates", tables=tables)
    # Then each counter is the sum of its stripes, in its own scope, and a name with a non-numeric tail is its own
    assert published == 47 and duplicates == 3
    assert st.counters[counters.RELAY] == {counters.PUBLISHED: 47, "published#x": 100}
    assert st.counters["shipping"] == {"duplicates": 3, counters.PUBLISHED: 1}
    assert st.duplicates_absorbed == {"shipping": 3}


def test_base_name_only_strips_a_numeric_stripe() -> None:
    assert [counters.base_name(n) for n in ("published#12", "published", "lease:prune", "a#b", "x#")] == [
        "published", "published", "lease:prune", "a#b", "x#"]
