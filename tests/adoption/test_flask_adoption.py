"""Adoption by a Flask team the way Flask teams work: an app factory, Flask-SQLAlchemy, its own ``orders``
package and its own Alembic environment, the ``FlaskOutbox`` extension, using only the public API and the
README. A real ``celery worker`` (Redis) runs the consumer and the team's plain task.

The app (tests/adoption/flask_shop) runs from its own directory with only itself and the installed
library on the path, so ``import orders`` must find the team's package and ``celery_outbox`` the library's.
Each step checks an item of the issue that made the integrations native (see the comments).
"""

from __future__ import annotations

import json
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
TOKEN = "operator-set-token-0123456789"

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]


def run(argv: list[str], env: dict[str, str], timeout: float = 120) -> str:
    return support.run(argv, cwd=HERE, env=env, timeout=timeout)


def python(code: str, env: dict[str, str]) -> str:
    return run([sys.executable, "-c", code], env)


def flask(env: dict[str, str], *args: str) -> str:
    return run([str(BIN / "flask"), "--app", "shop.app", *args], env)


def alembic(env: dict[str, str], call: str) -> str:
    return python("from alembic.config import Config; from alembic import command; c = Config();"
                  "c.set_main_option('script_location', 'migrations'); c.set_main_option('sqlalchemy.url', "
                  f"{env['SHOP_SQLALCHEMY_DATABASE_URI']!r}); {call}", env)


@pytest.fixture
def shop_env(tmp_path: Path) -> dict[str, str]:
    require_service("Redis", "127.0.0.1", 6379)
    # Configured as operators do: the app's own SHOP_* config (Flask's from_prefixed_env) and OUTBOX_* variables
    return {"PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(HERE), "HOME": str(tmp_path),
            "SHOP_SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path / 'shop.db'}",
            "SHOP_CELERY__broker_url": "redis://127.0.0.1:6379/3",
            "OUTBOX_NAMESPACE": f"shop{uuid.uuid4().hex[:8]}", "OUTBOX_ADMIN_TOKEN": TOKEN}


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


def test_a_flask_app_factory_with_flask_sqlalchemy_adopts_the_outbox(shop_env: dict[str, str], tmp_path: Path,
                                                                     worker: subprocess.Popen[bytes]) -> None:
    engine = sa.create_engine(shop_env["SHOP_SQLALCHEMY_DATABASE_URI"])
    log = tmp_path / "worker.log"
    # Given the team's database with its own orders table, migrated by its own Alembic environment
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE orders (id VARCHAR(64) NOT NULL PRIMARY KEY)")
    alembic(shop_env, "command.upgrade(c, 'head')")
    # and the library's tables created by `flask outbox db upgrade` (the extension's CLI group), checked by `outbox`
    flask(shop_env, "outbox", "db", "upgrade")
    run([str(BIN / "outbox"), "-A", "shop.worker", "db", "check"], shop_env)
    with engine.connect() as c:
        versions = {t: c.exec_driver_sql(f"SELECT version_num FROM {t}").scalar_one()
                    for t in ("alembic_version", "outbox_schema_version")}
    assert versions["alembic_version"] == "shop0001"
    # Item 7: the team's autogenerate proposes nothing (the library's tables, outbox_schema_version included)
    alembic(shop_env, "command.check(c)")
    # and the team's orders package is its own, the library the installed one
    paths = python("import orders, celery_outbox; print(orders.__file__); print(celery_outbox.__file__)",
                   shop_env).split()
    assert paths[0] == str(HERE / "orders" / "__init__.py") and not paths[1].startswith(str(HERE))

    # Item 8: the operator's OUTBOX_ADMIN_TOKEN takes effect; item 6: the probes are mounted by init_app
    statuses = python("from shop.worker import web; c = web.test_client(); print(c.get('/admin/dead-letters/')"
                      ".status_code, c.get('/admin/dead-letters/', headers={'Authorization': 'Bearer "
                      f"{TOKEN}'}}).status_code, c.get('/metrics').status_code)", shop_env).split()
    assert statuses == ["401", "200", "200"]

    # When an order is placed through the app (order, event and task in one commit) and the relay runs
    python("from shop.worker import web; r = web.test_client().post('/orders', json={'id': 'o-1'});"
           "assert r.status_code == 201, r.data", shop_env)
    flask(shop_env, "outbox", "relay", "--once")
    # Then the real worker applies the event once and runs the task once, on the team's default queue
    assert wait_for(engine, "SELECT count(*) FROM notifications", 1) == 1, log.read_text()[-3000:]
    assert wait_for(engine, "SELECT count(*) FROM confirmations WHERE order_id = 'o-1'", 1) == 1, \
        log.read_text()[-3000:]
    assert wait_for(engine, "SELECT count(*) FROM outbox_inbox", 1) == 1

    # Item 3: a script's .delay() with no transaction open writes its own row, sent by the relay later
    python("from shop.worker import web; from shop.app import confirm; confirm.delay('s-1')", shop_env)
    stats = json.loads(run([str(BIN / "outbox"), "-A", "shop.worker", "stats", "--json"], shop_env))
    assert stats["outbox"]["pending"] == 1
    run([str(BIN / "outbox"), "-A", "shop.worker", "relay", "--once"], shop_env)
    assert wait_for(engine, "SELECT count(*) FROM confirmations WHERE order_id = 's-1'", 1) == 1, \
        log.read_text()[-3000:]

    # When the same event is published again (a relay that died after publishing, before marking)
    with engine.begin() as c:
        c.exec_driver_sql("UPDATE outbox_messages SET published_at_ms = NULL WHERE type = 'OrderPlaced'")
    run([str(BIN / "outbox"), "-A", "shop.worker", "relay", "--once"], shop_env)
    # Then the inbox absorbs the duplicate: still one effect, one duplicate counted
    duplicates = ("SELECT coalesce(sum(value), 0) FROM outbox_counters "  # its stripes too (docs/operations.md)
                  "WHERE name = 'duplicates' OR substr(name, 1, 11) = 'duplicates#'")
    assert wait_for(engine, duplicates, 1) == 1
    with engine.connect() as c:
        assert c.exec_driver_sql("SELECT count(*) FROM notifications").scalar_one() == 1
    assert worker.poll() is None, log.read_text()[-3000:]
