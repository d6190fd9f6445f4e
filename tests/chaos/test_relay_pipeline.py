"""The pipelined relay's in-flight window (relay/loop.py ``_drain_pipelined``), killed for real.

A real ``outbox relay`` is SIGKILLed at ``relay_in_flight_next_claimed``: batch N is on the wire,
neither confirmed nor marked, and batch N+1 is claimed (its row locks held by a second connection).
After a restart nothing may be lost, every order has exactly one effect per consumer, and the
duplicates the inboxes absorbed are at most the rows in flight (``relay_max_in_flight_rows``) times
the consumers: N+1 was never published, so its claim must cost nothing.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_outbox.schema import Tables
from chaos import invariants
from chaos.environment import ChaosEnvironment
from chaos.load import make_plan as plan
from tests.services import require_service

pytestmark = [pytest.mark.chaos, pytest.mark.postgres, pytest.mark.workers, pytest.mark.slow]

IN_FLIGHT = 5  # relay_batch_size = relay_max_in_flight_rows: every batch is exactly this many rows
ORDERS = 3 * IN_FLIGHT + 2


@pytest.fixture(params=["redis", "rabbitmq"])
def env(request: pytest.FixtureRequest, tmp_path: Path, tables: Tables) -> Iterator[ChaosEnvironment]:
    require_service("PostgreSQL", "127.0.0.1", 5432)
    if request.param == "rabbitmq":
        require_service("RabbitMQ", "127.0.0.1", 5672)
    extra = {"OUTBOX_RELAY_BATCH_SIZE": str(IN_FLIGHT), "OUTBOX_RELAY_MAX_IN_FLIGHT_ROWS": str(IN_FLIGHT)}
    with ChaosEnvironment(broker=str(request.param), workdir=tmp_path / "chaos", tables=tables,
                          extra_env=extra) as environment:
        yield environment


def test_relay_killed_with_a_batch_in_flight_and_the_next_claimed_loses_nothing(env: ChaosEnvironment) -> None:
    # Given: more committed orders than two batches
    loader = env.orders(plan(ORDERS))
    loader.start()
    assert loader.wait_exit(timeout_s=60) == 0, env.logs()
    assert env.pending() == 2 * ORDERS  # an OrderPlaced row and a confirmation e-mail task row per order
    # When: the relay is SIGKILLed with batch N published-unmarked and batch N+1 claimed
    relay = env.relay()
    relay.start(crash_points="relay_in_flight_next_claimed")
    code = relay.wait_exit(timeout_s=60)
    assert code == -signal.SIGKILL, f"relay exit code {code}, expected SIGKILL\n{env.logs()}"
    # Then: nothing was marked (N was not marked, N+1 not even published), and the claim died with it
    assert env.pending() == 2 * ORDERS  # an OrderPlaced row and a confirmation e-mail task row per order
    # When: the relay restarts and the workers run
    relay.start()
    env.worker().start()

    def done() -> bool:
        with env.sessions() as s:
            return invariants.quiescent(s, tables=env.tables, consumers=env.consumers, expected_dead_letters=0)

    env.wait(done, timeout_s=90, what="quiescence")
    with env.sessions() as s:
        report = invariants.check(s, tables=env.tables, consumers=env.consumers, rolled_back=(), poison=(),
                                  min_duplicates=0)
    # Then: every invariant holds (no loss, one effect per order and consumer), and the duplicates are
    # bounded by the one batch that was in flight
    assert report.ok, f"{report.violations}\n{env.logs()}"
    assert report.snapshot.effects == {c: ORDERS for c in env.deliveries}
    assert report.snapshot.duplicates_absorbed <= IN_FLIGHT * len(env.consumers), env.logs()
