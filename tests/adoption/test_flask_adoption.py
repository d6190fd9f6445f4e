"""Adoption by a Flask + SQLAlchemy app that has its own ``orders`` package and its own Alembic environment,
using only the public API and the README: a real ``celery worker`` processes the event once, and a
re-published duplicate is absorbed.

The app (tests/adoption/flask_shop) runs from its own directory with only itself and the installed
library on the path, so ``import orders`` must find the team's package and ``celery_outbox`` the library's.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.adoption import support
from tests.services import require_service

HERE = Path(__file__).resolve().parent / "flask_shop"
BIN = support.BIN

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]


def run(argv: list[str], env: dict[str, str], timeout: float = 120) -> str:
    return support.run(argv, cwd=HERE, env=env, timeout=timeout)


def python(code: str, env: dict[str, str]) -> str:
    return run([sys.executable, "-c", code], env)


@pytest.fixture
def shop_env(tmp_path: Path) -> dict[str, str]:
    require_service("Redis", "127.0.0.1", 6379)
    return {"PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(HERE), "HOME": str(tmp_path),
            "SHOP_DATABASE_URL": f"sqlite:///{tmp_path / 'shop.db'}", "SHOP_BROKER_URL": "redis://127.0.0.1:6379/3",
            "SHOP_NAMESPACE": f"shop{uuid.uuid4().hex[:8]}"}


@pytest.fixture
def worker(shop_env: dict[str, str], tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    with support.celery_worker("shop.worker", cwd=HERE, env=shop_env, log_path=tmp_path / "worker.log") as proc:
        yield proc


def wait_for(engine: sa.Engine, sql: str, expected: int, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    value = -1
    while time.monotonic() < deadline:
        with engine.connect() as c:
            value = int(c.exec_driver_sql(sql).scalar_one())
        if value == expected:
            return value
        time.sleep(0.2)
    return value


def test_a_flask_app_with_its_own_orders_package_adopts_the_outbox(shop_env: dict[str, str], tmp_path: Path,
                                                                  worker: subprocess.Popen[bytes]) -> None:
    url = shop_env["SHOP_DATABASE_URL"]
    engine = sa.create_engine(url)
    # Given the team's database with its own orders table, migrated by its own Alembic environment
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE orders (id VARCHAR(64) PRIMARY KEY)")
    python("from alembic.config import Config; from alembic import command; c = Config();"
           "c.set_main_option('script_location', 'migrations'); c.set_main_option('sqlalchemy.url', "
           f"{url!r}); command.upgrade(c, 'head')", shop_env)
    # and the library's tables created by `outbox db upgrade` with a version table of their own
    run([str(BIN / "outbox"), "-A", "shop.worker", "db", "upgrade"], shop_env)
    run([str(BIN / "outbox"), "-A", "shop.worker", "db", "check"], shop_env)
    with engine.connect() as c:
        tables = set(sa.inspect(c).get_table_names())
        versions = {t: c.exec_driver_sql(f"SELECT version_num FROM {t}").scalar_one()
                    for t in ("alembic_version", "outbox_schema_version")}
    assert {"orders", "notifications", "outbox_messages", "outbox_inbox"} <= tables
    assert versions["alembic_version"] == "shop0001"
    # and the team's orders package is its own, the library the installed one
    paths = python("import orders, celery_outbox; print(orders.__file__); print(celery_outbox.__file__)",
                   shop_env).split()
    assert paths[0] == str(HERE / "orders" / "__init__.py") and not paths[1].startswith(str(HERE))

    # When an order is placed through the app and the relay runs
    python("from shop.worker import web; r = web.test_client().post('/orders', json={'id': 'o-1'});"
           "assert r.status_code == 201, r.data", shop_env)
    run([str(BIN / "outbox"), "-A", "shop.worker", "relay", "--once"], shop_env)

    # Then the real worker applies the effect once and records it in the inbox
    assert wait_for(engine, "SELECT count(*) FROM outbox_inbox", 1) == 1
    assert wait_for(engine, "SELECT count(*) FROM notifications", 1) == 1

    # When the same event is published again (a relay that died after publishing, before marking)
    with engine.begin() as c:
        c.exec_driver_sql("UPDATE outbox_messages SET published_at_ms = NULL")
    run([str(BIN / "outbox"), "-A", "shop.worker", "relay", "--once"], shop_env)

    # Then the inbox absorbs the duplicate: still one effect, one duplicate counted
    assert wait_for(engine, "SELECT coalesce(sum(value), 0) FROM outbox_counters WHERE name = 'duplicates'", 1) == 1
    with engine.connect() as c:
        assert c.exec_driver_sql("SELECT count(*) FROM notifications").scalar_one() == 1
    assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
