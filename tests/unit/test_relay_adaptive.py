"""The adaptive batch size as a pure object (relay/adaptive.py): no clock, no database, no broker."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_outbox.errors import ConfigError
from celery_outbox.relay.adaptive import AdaptiveBatch, CommitRate


def test_full_batches_double_the_size_up_to_the_in_flight_bound() -> None:
    sizer = AdaptiveBatch(minimum=100, maximum=1000)
    sizes = [sizer.size]
    for _ in range(6):
        sizes.append(sizer.observe(asked=sizer.size, claimed=sizer.size))
    assert sizes == [100, 200, 400, 800, 1000, 1000, 1000]


def test_an_idle_outbox_halves_the_size_down_to_the_minimum() -> None:
    sizer = AdaptiveBatch(minimum=100, maximum=1000)
    sizer.size = 1000
    sizes = [sizer.observe(asked=sizer.size, claimed=0) for _ in range(5)]
    assert sizes == [500, 250, 125, 100, 100]


def test_a_partly_full_batch_keeps_the_size() -> None:
    # Given a batch that came back more than a quarter but less than fully full: a steady trickle
    sizer = AdaptiveBatch(minimum=10, maximum=1000)
    sizer.size = 400
    assert sizer.observe(asked=400, claimed=101) == 400
    assert sizer.observe(asked=400, claimed=399) == 400
    # a quarter or less is idle enough to shrink
    assert sizer.observe(asked=400, claimed=100) == 200


def test_a_small_probe_batch_does_not_count_as_full() -> None:
    # Given the circuit breaker asked for a 5-row probe while the size is 400, and got 5 rows
    sizer = AdaptiveBatch(minimum=10, maximum=1000)
    sizer.size = 400
    # Then the size does not grow on the probe's account (it was not asked to take 400)
    assert sizer.observe(asked=5, claimed=5) == 400


@pytest.mark.parametrize(("minimum", "maximum"), [(0, 10), (11, 10), (-1, 5)])
def test_bounds_are_checked(minimum: int, maximum: int) -> None:
    with pytest.raises(ConfigError, match="minimum <= maximum"):
        AdaptiveBatch(minimum=minimum, maximum=maximum)


@given(minimum=st.integers(1, 50), extra=st.integers(0, 500),
       fills=st.lists(st.tuples(st.floats(0, 1.5), st.booleans()), max_size=60))
def test_the_size_always_stays_between_the_bounds(minimum: int, extra: int, fills: list[tuple[float, bool]]) -> None:
    sizer = AdaptiveBatch(minimum=minimum, maximum=minimum + extra)
    for fraction, probe in fills:
        asked = min(sizer.size, 3) if probe else sizer.size
        claimed = min(asked, int(asked * fraction))
        size = sizer.observe(asked=asked, claimed=claimed)
        assert minimum <= size <= minimum + extra


def test_a_trickle_expects_no_commit_within_a_short_window() -> None:
    # Given 20 commits a second for two seconds
    rate = CommitRate(horizon_s=1.0)
    for i in range(40):
        rate.add(1, at=i / 20)
    # Then about 20/s, which expects one more within 100 ms but not within 5 ms
    assert 15 < rate.per_s(at=2.0) < 25
    assert rate.expects_more(0.1, at=2.0)
    assert not rate.expects_more(0.005, at=2.0)


def test_a_burst_expects_more_and_is_forgotten_after_a_quiet_spell() -> None:
    # Given 500 commits a second for a second
    rate = CommitRate(horizon_s=1.0)
    for i in range(500):
        rate.add(1, at=i / 500)
    # Then a 5 ms window expects more commits
    assert rate.expects_more(0.005, at=1.0)
    # And ten quiet seconds later it does not
    assert not rate.expects_more(0.005, at=11.0)
    assert rate.per_s(at=11.0) < 0.1


def test_a_window_can_ask_for_several_commits() -> None:
    # Given 100 commits a second for two seconds
    rate = CommitRate(horizon_s=1.0)
    for i in range(200):
        rate.add(1, at=i / 100)
    # Then a 20 ms window expects one more commit, but not the four the relay's gather asks for
    assert rate.expects_more(0.02, at=2.0)
    assert not rate.expects_more(0.02, at=2.0, commits=4)
    # And a 50 ms window expects four; asking for less than one commit is asking for one
    assert rate.expects_more(0.05, at=2.0, commits=4)
    assert rate.expects_more(0.02, at=2.0, commits=0) == rate.expects_more(0.02, at=2.0)


def test_no_window_or_no_commit_never_gathers() -> None:
    rate = CommitRate()
    assert not rate.expects_more(10.0, at=0.0)
    rate.add(1000, at=0.0)
    assert not rate.expects_more(0.0, at=0.0)


@pytest.mark.parametrize("horizon", [0.0, -1.0, float("nan"), float("inf")])
def test_the_horizon_must_be_a_positive_number(horizon: float) -> None:
    with pytest.raises(ConfigError, match="horizon"):
        CommitRate(horizon_s=horizon)


@given(st.lists(st.tuples(st.integers(0, 100), st.floats(0, 10)), max_size=50), st.floats(0, 20))
def test_the_rate_is_never_negative_and_time_going_back_does_not_inflate_it(
        events: list[tuple[int, float]], later: float) -> None:
    rate = CommitRate()
    total = 0
    for commits, at in events:
        rate.add(commits, at=at)
        total += commits
    assert 0 <= rate.per_s(at=later) <= total
