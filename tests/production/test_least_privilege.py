"""The whole pipeline as a least-privilege role (docs/deployment.md, "A least-privilege role").

Migrations run as the owner role; the order writer, the relay, the workers and the ``outbox`` commands
run as a role with only the GRANTs ``postgres_checks.grant_statements`` lists (and the deployment's own
tables): not the owner, no superuser, no DDL, no trigger creation. Any permission error fails the run.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.inbox.receipts import record_many
from chaos.processes import BIN
from tests.production import pipeline
from tests.production.roles import RolesEnvironment
from tests.services import require_service

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]

DENIED = ("permission denied", "InsufficientPrivilege", "must be owner")


def outbox_cli(env: RolesEnvironment, *args: str) -> subprocess.CompletedProcess[str]:
    """An ``outbox`` command of the deployment, as a process configured like the others (the app role)."""
    return subprocess.run([str(BIN / "outbox"), "-A", "relay.app", *args], env={**os.environ, **env.env},
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120,
                          check=False)


def role_facts(env: RolesEnvironment) -> tuple[bool, set[str]]:
    """(the app role is a superuser, the owners of the library's tables)."""
    with env.sessions() as s:
        superuser = bool(s.execute(sa.text("SELECT rolsuper FROM pg_roles WHERE rolname = :r"), {"r": env.app}).scalar())
        owners = set(s.execute(sa.text("SELECT DISTINCT tableowner FROM pg_tables WHERE tablename = ANY(:t)"),
                               {"t": list(env.tables.names())}).scalars())
    return superuser, owners


def test_the_whole_pipeline_runs_as_a_role_with_only_the_documented_grants(tmp_path: Path) -> None:
    require_service("PostgreSQL", "127.0.0.1", 5432)
    require_service("Redis", "127.0.0.1", 6379)
    with RolesEnvironment(broker="redis", workdir=tmp_path) as env:
        # Given tables owned by the owner role, and every process running as the app role, which is not
        assert role_facts(env) == (False, {env.owner})
        env.relay().start()
        env.worker("worker", queues=["billing", "search", "email"]).start()
        # When orders are committed (one rolled back), a poison message is dead-lettered, and one published
        # shipping message is lost from the broker before any worker took it
        rolled_back = pipeline.place_orders(env, 20, rollback=frozenset({5}))
        poison = [env.poison(consumer="billing")]
        env.wait(lambda: env.pending() == 0 and env.count(env.tables.outbox) >= 38, timeout_s=60, what="all published")
        lost = env.take_and_lose("shipping")
        assert lost is not None
        env.worker("shipper", queues=["shipping"]).start()
        # Then every order's effects happen exactly once, the lost one re-sent by the reconciler,
        pipeline.wait_quiescent(env, committed=19, dead_letters=1, timeout_s=90)
        report = pipeline.check(env, rolled_back=rolled_back, poison=poison)
        assert report.ok, report.violations
        assert report.snapshot.reconciled_events >= 1
        # and the operator's commands work as the app role too: stats, retention, dead letters, check
        for args in (["stats"], ["prune", "--published-older-than", "1d"], ["dead-letters", "list"],
                     ["check", "--no-broker"]):
            done = outbox_cli(env, *args)
            assert done.returncode == 0, (args, done.stdout, done.stderr)
        # and a plain task's receipt is written as the app role (the worker's statement, celery_outbox/inbox/receipts.py)
        engine = make_engine(env.process_database_url)
        try:
            with make_session_factory(engine)() as session:
                assert record_many(session, {uuid.uuid4(): 1}, tables=env.tables) == 1
        finally:
            engine.dispose()
        # and no process of the run met a permission error
        logs = env.logs() + "".join(p.log_path.read_text(errors="replace") for p in env.processes.members)
        assert not [word for word in DENIED if word in logs], env.logs()


def test_check_names_a_missing_grant(tmp_path: Path) -> None:
    require_service("PostgreSQL", "127.0.0.1", 5432)
    require_service("Redis", "127.0.0.1", 6379)
    with RolesEnvironment(broker="redis", workdir=tmp_path) as env:
        # Given the app role with every documented grant: the check passes
        ok = outbox_cli(env, "check", "--no-broker")
        assert ok.returncode == 0 and ok.stderr == "", ok.stderr
        # When the operator forgot one (DELETE on the inbox, which retention needs)
        env.admin(f'REVOKE DELETE ON {env.tables.table(env.tables.inbox).name} FROM "{env.app}"', in_database=True)
        done = outbox_cli(env, "check", "--no-broker")
        # Then the check fails with one line naming it, and nothing else
        assert done.returncode == 3, (done.stdout, done.stderr)
        assert done.stderr.splitlines() == [
            f"grants: role {env.app} lacks DELETE on outbox_inbox (docs/deployment.md, 'A least-privilege role')"]


