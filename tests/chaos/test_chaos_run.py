"""The ``outbox chaos`` run itself, short, on both brokers; and proof that its checks can fail."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from chaos import invariants
from chaos.environment import ChaosEnvironment
from chaos.harness import plan_kills, run_chaos
from chaos.load import make_plan as plan
from consumers.models import Shipment
from devtools.__main__ import cli

pytestmark = [pytest.mark.chaos, pytest.mark.postgres, pytest.mark.workers, pytest.mark.slow]


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_short_chaos_run_holds_every_invariant(broker: str, tmp_path: Path,
                                               require: Callable[[str, str, int], None]) -> None:
    require("PostgreSQL", "127.0.0.1", 5432)
    if broker == "rabbitmq":
        require("RabbitMQ", "127.0.0.1", 5672)
    # Given/When: 40 orders, 6 SIGKILLs at crash points, one broker outage, poison and duplicates
    report = run_chaos(orders=40, kills=6, broker=broker, seed=7, workdir=tmp_path / "run", timeout_s=150)
    # Then: every invariant holds and the provocations really happened
    assert report.invariants is not None
    assert report.ok, (report.invariants.violations, report.unexpected_exits)
    assert sum(report.kills.values()) >= 3, (report.kills, report.armed_not_reached)
    assert report.outage_s > 0 and report.second_relay_s > 0
    assert report.invariants.snapshot.dead_letters == report.poison == 2
    assert report.invariants.snapshot.duplicates_absorbed >= report.duplicates_injected > 0
    assert len(report.matrix) == 9 and all(row.ok for row in report.matrix)


def test_kill_plan_is_reproducible_and_covers_every_crash_point() -> None:
    import random

    a = plan_kills(12, random.Random(3))
    b = plan_kills(12, random.Random(3))
    assert a == b
    points = {spec.partition("@")[0] for q in a.values() for spec in q}
    assert points == {"after_order_commit", "after_claim_before_publish", "after_publish_before_mark",
                      "after_mark", "consumer_before_commit", "consumer_after_commit_before_ack"}


def test_invariants_catch_lost_and_doubled_effects(redis_chaos: ChaosEnvironment) -> None:
    env = redis_chaos
    # Given: orders committed but never relayed, and one order's shipment written twice by hand
    loader = env.orders(plan(3))
    loader.start()
    assert loader.wait_exit(timeout_s=60) == 0, env.logs()
    with env.sessions() as s:
        payload = s.execute(sa.select(env.tables.outbox.payload)
                            .where(env.tables.outbox.type == invariants.ORDER_PLACED)).scalars().first()
        assert payload is not None
        order_id = payload["order_id"]
        for _ in range(2):
            s.add(Shipment(order_id=order_id, address_line="", items=1, created_at_ms=0))
        s.commit()
        # When: the invariants are checked
        report = invariants.check(s, tables=env.tables, consumers=env.consumers, rolled_back=[],
                                  poison=[("billing", "x")])
    # Then: each broken rule is reported
    names = {v.invariant for v in report.violations}
    assert not report.ok
    assert "relay drained" in names
    assert "shipping: exactly one effect per order" in names
    assert "billing: every order seen once" in names
    assert "email: every order seen once" in names  # the confirmation e-mail task never ran
    assert "email: exactly one effect per order" in names  # ... so no order got its e-mail
    assert "dead letters are exactly the poison" in names


def test_cli_rejects_an_unknown_broker() -> None:
    result = CliRunner().invoke(cli, ["chaos", "--broker", "kafka"])
    assert result.exit_code == 2
    assert "kafka" in result.output
