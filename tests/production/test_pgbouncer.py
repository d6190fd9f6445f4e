"""The whole pipeline behind PgBouncer in transaction pooling mode (docs/deployment.md, "Behind PgBouncer").

The web side (the order writer), the relay and the workers (consumers, the e-mail task with its
receipts) know only the pooler's URL; the checks read the database directly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from chaos.environment import ChaosEnvironment
from tests.production import pipeline
from tests.production.pgbouncer import PgBouncer
from tests.services import require_service

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]


def test_the_pipeline_runs_through_a_transaction_pooler(pgbouncer: PgBouncer, tmp_path: Path) -> None:
    require_service("Redis", "127.0.0.1", 6379)
    with ChaosEnvironment(broker="redis", workdir=tmp_path) as env:
        # Given every process of the deployment configured with the pooler's URL only
        env.process_database_url = pgbouncer.url(env.database_url)
        env.relay().start()
        env.worker().start()
        # When the web side commits 30 orders (3 of them rolled back inside their transaction)
        rolled_back = pipeline.place_orders(env, 30, rollback=frozenset({4, 11, 27}))
        pipeline.wait_quiescent(env, committed=27, timeout_s=90)
        # Then every committed order's effects happened exactly once, nothing of a rolled-back one,
        report = pipeline.check(env, rolled_back=rolled_back)
        assert report.ok, report.violations
        assert report.snapshot.effects == {"shipping": 27, "billing": 27, "search": 27, "email": 27}
        # and all of it went through the pooler (its own count of the transactions it passed on)
        assert pgbouncer.transactions(sa.make_url(env.database_url).database or "") > 27 * 4
