"""A chaos environment whose database belongs to an owner role and whose processes run as an app role.

The owner (``outbox_owner_<hex>``) owns the database and runs the migrations (the library's tables,
their NOTIFY trigger, the reference deployment's tables); the app role (``outbox_app_<hex>``): LOGIN,
no superuser, no CREATEDB or CREATEROLE, owns nothing, and gets only the GRANTs of
``postgres_checks.grant_statements`` plus the deployment's own tables. Every process of the run (order
writer, relay, workers, ``outbox`` commands) connects as the app role, directly or through a pooler;
the environment's own checks read the database as the admin. ``role_settings`` are set on the app role
(``ALTER ROLE ... SET``), the way a managed service sets timeouts.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.ops.postgres_checks import grant_statements
from chaos.environment import ChaosEnvironment
from orders import migrate
from tests.production.pgbouncer import PgBouncer

# The reference deployment's own tables (orders/, consumers/): the app reads and writes them, and reads
# its Alembic version table.
DEPLOYMENT_TABLES = ("orders", "order_lines", "shipments", "invoices", "search_documents", "sent_emails")
DEPLOYMENT_READ_ONLY = ("alembic_version",)


def role_names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"outbox_owner_{tag}", f"outbox_app_{tag}"


class RolesEnvironment(ChaosEnvironment):
    """See the module docstring. ``pooler``: the processes reach Postgres through it (as the app role)."""

    def __init__(self, *, role_settings: Mapping[str, str] | None = None, pooler: PgBouncer | None = None,
                 owner: str = "", app: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        names = role_names()
        self.owner, self.app = owner or names[0], app or names[1]
        self.role_settings = dict(role_settings or {})
        self.pooler = pooler

    def url_as(self, role: str) -> str:
        return sa.make_url(self.database_url).set(username=role, password=None).render_as_string(hide_password=False)

    def admin(self, *statements: str, in_database: bool = False) -> None:
        """Run ``statements`` as the admin (superuser), on the server or in this run's database."""
        url = self.database_url if in_database else self.pg_admin_url
        engine = make_engine(url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as c:
                for stmt in statements:
                    c.exec_driver_sql(stmt)
        finally:
            engine.dispose()

    def __enter__(self) -> RolesEnvironment:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.admin(f'CREATE ROLE "{self.owner}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE',
                   f'CREATE ROLE "{self.app}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT',
                   *(f'ALTER ROLE "{self.app}" SET {k} = \'{v}\'' for k, v in self.role_settings.items()),
                   f'CREATE DATABASE "{self.db_name}" OWNER "{self.owner}"')
        try:
            migrate.upgrade(self.url_as(self.owner))  # the library's and the deployment's tables, as their owner
            owner = make_engine(self.url_as(self.owner))
            try:
                with owner.begin() as c:
                    for stmt in grant_statements(self.tables, self.app):
                        c.exec_driver_sql(stmt)
                    c.exec_driver_sql(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {', '.join(DEPLOYMENT_TABLES)} "
                                      f'TO "{self.app}"')
                    c.exec_driver_sql(f"GRANT SELECT ON {', '.join(DEPLOYMENT_READ_ONLY)} TO \"{self.app}\"")
            finally:
                owner.dispose()
            app_url = self.url_as(self.app)
            self.process_database_url = self.pooler.url(app_url) if self.pooler is not None else app_url
            self._engine = make_engine(self.database_url)
            self._sessions = make_session_factory(self._engine)
            self.broker.start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        try:
            super().close()  # the processes, the broker's queues, the database
        finally:
            self.admin(f'DROP ROLE IF EXISTS "{self.app}"', f'DROP ROLE IF EXISTS "{self.owner}"')
