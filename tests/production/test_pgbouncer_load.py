"""1,000 orders through PgBouncer (transaction pooling), with the relay and a worker SIGKILLed mid-run:
0 lost, 0 doubled (docs/deployment.md, "Behind PgBouncer").

Every process reaches Postgres through the pooler only; the relay LISTENs on a direct
``OUTBOX_RELAY_LISTEN_URL`` (the production configuration). The figures are read from the database
alone (chaos/invariants.py): one effect per committed order per consumer and one confirmation e-mail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.environment import ChaosEnvironment
from orders.models import Order
from tests.production import pipeline
from tests.production.pgbouncer import PgBouncer
from tests.services import require_service

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers, pytest.mark.chaos, pytest.mark.slow]

ORDERS = 1_000


def test_a_thousand_orders_through_the_pooler_survive_a_relay_and_a_worker_sigkill(
        pgbouncer: PgBouncer, tmp_path: Path) -> None:
    require_service("Redis", "127.0.0.1", 6379)
    with ChaosEnvironment(broker="redis", workdir=tmp_path) as env:
        # Given the deployment behind the pooler: the order writer, the relay (LISTENing directly) and two workers
        env.process_database_url = pgbouncer.url(env.database_url)
        env.extra_env["OUTBOX_RELAY_LISTEN_URL"] = env.database_url
        relay = env.relay()
        relay.start()
        workers = [env.worker(f"worker{i}") for i in range(2)]
        for w in workers:
            w.start()
        # When 1,000 orders are committed (every 20th rolled back inside its transaction) as fast as the writer can,
        rolled_back = pipeline.place_orders(env, ORDERS, rollback=frozenset(range(0, ORDERS, 20)))
        committed = ORDERS - len(rolled_back)
        # and the relay is SIGKILLed at a third of them and a worker at two thirds, each started again
        env.wait(lambda: env.count(Order) >= committed // 3, timeout_s=120, what="a third of the orders")
        relay.kill()
        relay.start()
        env.wait(lambda: env.count(Order) >= 2 * committed // 3, timeout_s=120, what="two thirds of the orders")
        workers[0].kill()
        workers[0].start()
        # Then every committed order's effects happen exactly once: none lost, none doubled
        pipeline.wait_quiescent(env, committed=committed, timeout_s=150)
        report = pipeline.check(env, rolled_back=rolled_back)
        assert report.ok, report.violations
        snap = report.snapshot
        assert (snap.committed_orders, snap.missing_effects, snap.extra_effects) == (committed, 0, 0)
        assert snap.effects == {"shipping": committed, "billing": committed, "search": committed, "email": committed}
        assert relay.incarnation == workers[0].incarnation == 2
        assert "listening on outbox_pending through OUTBOX_RELAY_LISTEN_URL" in relay.log_path.read_text()
