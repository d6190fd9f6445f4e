"""Adoption by a Django project laid out the conventional way (tests/adoption/django_project): ``proj/celery.py``
builds the Celery app and the ``DjangoOutbox``, ``proj/__init__.py`` imports it (``from .celery import app as
celery_app``), ``@shared_task`` tasks live in ``orders/tasks.py``, the consumer is included in the orders app's
``AppConfig.ready()``, and ``ATOMIC_REQUESTS=True`` makes each view one transaction. Using only the public API
(``celery_outbox`` and ``celery_outbox.contrib.django``): ``manage.py migrate`` creates the library's tables
beside the project's, a real ``celery worker`` applies the event once, a re-published duplicate is absorbed by
the inbox, and the team's own ``TestCase``/``TransactionTestCase`` (``manage.py test``) write the test database.

The project runs from its own directory with only itself and the installed library on the path, so
``import orders`` must find the project's app and ``celery_outbox`` the library's.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing
from pathlib import Path

import pytest

from tests.adoption import support
from tests.services import require_service

HERE = Path(__file__).resolve().parent / "django_project"
BIN = support.BIN

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]

OUTBOX_TABLES = {"outbox_messages", "outbox_inbox", "outbox_attempts", "outbox_dead_letters", "outbox_parked",
                 "outbox_entity_versions", "outbox_counters"}


def run(argv: list[str], env: dict[str, str], timeout: float = 120) -> str:
    return support.run(argv, cwd=HERE, env=env, timeout=timeout)


def manage(env: dict[str, str], *args: str) -> str:
    return run([sys.executable, "manage.py", *args], env)


def relay_once(env: dict[str, str]) -> str:
    return manage(env, "outbox", "relay", "--once")


def query(db: Path, sql: str) -> list[tuple[object, ...]]:
    with closing(sqlite3.connect(db, timeout=10)) as c:
        return c.execute(sql).fetchall()


def execute(db: Path, sql: str) -> None:
    with closing(sqlite3.connect(db, timeout=10)) as c, c:
        c.execute(sql)


def wait_for(db: Path, sql: str, expected: int, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    value = -1
    while time.monotonic() < deadline:
        try:
            value = int(query(db, sql)[0][0])  # type: ignore[call-overload]
        except sqlite3.OperationalError:  # the worker holds the write lock for a moment
            value = -1
        if value == expected:
            return value
        time.sleep(0.2)
    return value


@pytest.fixture
def project_env(tmp_path: Path) -> dict[str, str]:
    require_service("Redis", "127.0.0.1", 6379)
    namespace = f"djshop{uuid.uuid4().hex[:8]}"  # queues of this run only: other runs share the broker
    return {"PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(HERE), "HOME": str(tmp_path),
            "SHOP_DB_PATH": str(tmp_path / "shop.sqlite3"), "SHOP_BROKER_URL": "redis://127.0.0.1:6379/4",
            "SHOP_NAMESPACE": namespace, "SHOP_TASK_QUEUE": f"{namespace}.tasks"}


@pytest.fixture
def start_worker(project_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    with ExitStack() as stack:
        yield lambda *pool: stack.enter_context(support.celery_worker("proj", cwd=HERE, env=project_env,
                                                                       log_path=tmp_path / "worker.log",
                                                                       pool=pool or ("-P", "solo")))


def test_a_django_project_with_its_own_orders_app_adopts_the_outbox(
        project_env: dict[str, str], tmp_path: Path, start_worker: Callable[..., subprocess.Popen[bytes]]) -> None:
    db = Path(project_env["SHOP_DB_PATH"])
    # Given the project migrated by Django's own `migrate`: its tables and the library's, from their migrations
    manage(project_env, "migrate", "--no-input")
    tables = {name for (name,) in query(db, "SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"orders_order", "orders_notification"} <= tables
    assert tables >= OUTBOX_TABLES, sorted(OUTBOX_TABLES - tables)
    applied = {app for (app,) in query(db, "SELECT app FROM django_migrations")}
    assert {"orders", "celery_outbox"} <= applied
    # and the models agree with the migrations (the project's and the library's)
    manage(project_env, "makemigrations", "--check", "--dry-run")
    # and the library's own checks accept the schema Django created: one schema, two ways to create it
    run([str(BIN / "outbox"), "-A", "proj.celery", "check"], project_env)
    manage(project_env, "outbox", "check")
    run([str(BIN / "outbox"), "-A", "proj.celery", "db", "upgrade"], project_env)  # nothing to do, no error
    # and the project's orders app is its own, the library the installed one
    paths = run([sys.executable, "-c", "import orders, celery_outbox; print(orders.__file__); "
                 "print(celery_outbox.__file__)"], project_env).split()
    assert paths[0] == str(HERE / "orders" / "__init__.py") and not paths[1].startswith(str(HERE))
    app_path = manage(project_env, "shell", "-c", "from django.apps import apps; "
                                                  "print(apps.get_app_config('orders').path)").splitlines()[-1]
    assert app_path == str(HERE / "orders")

    worker = start_worker()
    # When an order is placed through the project's view (ATOMIC_REQUESTS: the order, its event and its
    # @shared_task's .delay() in one transaction)
    manage(project_env, "shell", "-c", "from django.test import Client; "
                                       "r = Client().post('/orders', {'id': 'o-1'}, content_type='application/json'); "
                                       "assert r.status_code == 201, r.content")
    assert query(db, "SELECT id FROM orders_order") == [("o-1",)]
    assert query(db, "SELECT type FROM outbox_messages WHERE published_at_ms IS NULL ORDER BY seq") == \
        [("OrderPlaced",), ("orders.confirm",)]
    # and the relay runs (manage.py outbox: the project's outbox, its consumer included in AppConfig.ready())
    relay_once(project_env)

    # Then the real worker applies the effect once and records it in the inbox, and runs the task
    assert wait_for(db, "SELECT count(*) FROM outbox_inbox", 1) == 1, (tmp_path / "worker.log").read_text()[-3000:]
    assert wait_for(db, "SELECT count(*) FROM orders_notification", 2) == 2
    assert query(db, "SELECT consumer, type FROM outbox_inbox") == [("notify", "OrderPlaced")]

    # When the same event is published again (a relay that died after publishing, before marking), this time
    # by the standalone relay, which imports proj.celery without starting Django: the routes of the consumer
    # included in AppConfig.ready() still reach it
    execute(db, "UPDATE outbox_messages SET published_at_ms = NULL WHERE type = 'OrderPlaced'")
    run([str(BIN / "outbox"), "-A", "proj.celery", "relay", "--once"], project_env)
    assert query(db, "SELECT count(*) FROM outbox_messages WHERE dead_lettered_at_ms IS NOT NULL") == [(0,)]

    # Then the inbox absorbs the duplicate: still one effect, one duplicate counted
    duplicates = ("SELECT coalesce(sum(value), 0) FROM outbox_counters "  # its stripes too (docs/operations.md)
                  "WHERE name = 'duplicates' OR substr(name, 1, 11) = 'duplicates#'")
    assert wait_for(db, duplicates, 1) == 1, (tmp_path / "worker.log").read_text()[-3000:]
    assert sorted(query(db, "SELECT order_id FROM orders_notification")) == [("confirmed:o-1",), ("o-1",)]
    assert query(db, "SELECT count(*) FROM outbox_inbox") == [(1,)]
    assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]


def shell(env: dict[str, str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "manage.py", "shell", "-c", code], cwd=HERE, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_process_not_bound_to_the_outbox_fails_loudly_at_the_first_delay(
        project_env: dict[str, str], tmp_path: Path) -> None:
    db = Path(project_env["SHOP_DB_PATH"])
    manage(project_env, "migrate", "--no-input")
    # Given the same project in the layout that never binds its web process: nothing Django loads at start-up
    # imports proj/celery.py (an empty proj/__init__.py, the consumer not included in AppConfig.ready())
    unbound = tmp_path / "unbound_project"
    shutil.copytree(HERE, unbound, ignore=shutil.ignore_patterns("__pycache__"))
    (unbound / "proj" / "__init__.py").write_text("")
    (unbound / "orders" / "apps.py").unlink()
    env = {**project_env, "PYTHONPATH": str(unbound)}
    # When a @shared_task is sent from it
    out = subprocess.run([sys.executable, "manage.py", "shell", "-c", "from orders.tasks import confirm; "
                          "confirm.delay('o-1')"], cwd=unbound, env=env, capture_output=True, text=True, timeout=120)
    # Then the first .delay() fails with one clear line, and nothing is written or sent
    assert out.returncode != 0
    assert "ConfigError: task 'orders.confirm' was sent through Celery's default app" in out.stderr, out.stderr[-3000:]
    assert query(db, "SELECT count(*) FROM outbox_messages") == [(0,)]


def test_delay_in_a_shell_is_a_committed_row_that_a_real_worker_runs(
        project_env: dict[str, str], tmp_path: Path, start_worker: Callable[..., subprocess.Popen[bytes]]) -> None:
    db = Path(project_env["SHOP_DB_PATH"])
    manage(project_env, "migrate", "--no-input")
    # Given a process of the project (bound: proj/__init__.py imports proj/celery.py) sending a @shared_task
    # with no atomic() open
    out = shell(project_env, "from orders.tasks import confirm; print(confirm.delay('o-1').id)")
    assert out.returncode == 0, out.stderr[-3000:]
    task_id = out.stdout.split()[-1]
    # Then its row is committed already, before any relay or worker ran
    assert query(db, "SELECT type, published_at_ms FROM outbox_messages") == [("orders.confirm", None)]
    # and the relay hands it to a real worker, which runs it once
    start_worker()
    relay_once(project_env)
    assert wait_for(db, "SELECT count(*) FROM orders_notification WHERE order_id = 'confirmed:o-1'", 1) == 1, \
        (tmp_path / "worker.log").read_text()[-3000:]
    assert query(db, "SELECT replace(message_id, '-', '') FROM outbox_messages") == [(task_id.replace("-", ""),)]


def test_a_plain_task_whose_worker_process_is_sigkilled_mid_task_is_redelivered(
        project_env: dict[str, str], tmp_path: Path, start_worker: Callable[..., subprocess.Popen[bytes]]) -> None:
    db = Path(project_env["SHOP_DB_PATH"])
    marker = tmp_path / "killed-once"
    manage(project_env, "migrate", "--no-input")
    # Given a plain @shared_task, with only what DjangoOutbox sets (no acks_late in settings.py or on the task),
    # committed as a row by a bound shell and published by the relay
    out = shell(project_env, f"from orders.tasks import confirm_once_killed; "
                             f"confirm_once_killed.delay('o-9', {str(marker)!r})")
    assert out.returncode == 0, out.stderr[-3000:]
    # When a real prefork worker takes it and its process is SIGKILLed mid-task
    worker = start_worker("-P", "prefork", "-c", "1")
    relay_once(project_env)
    # Then the message is not lost: redelivered, it runs to the end once
    assert wait_for(db, "SELECT count(*) FROM orders_notification WHERE order_id = 'confirmed:o-9'", 1) == 1, \
        (tmp_path / "worker.log").read_text()[-3000:]
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert marker.read_text() == "killed" and "signal 9" in log, log[-3000:]  # it really was killed mid-task
    assert worker.poll() is None


KILL = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"


def test_each_idiom_under_a_sigkill_right_after_the_commit_delivers_what_the_docs_promise(
        project_env: dict[str, str], tmp_path: Path, start_worker: Callable[..., subprocess.Popen[bytes]]) -> None:
    db = Path(project_env["SHOP_DB_PATH"])
    manage(project_env, "migrate", "--no-input")
    bound = "import os, signal; from django.db import transaction; " \
            "from orders.models import Order; from orders.tasks import confirm; "
    # Given three processes, each SIGKILLed right after its commit, before any relay ran:
    # a script's .delay() (its row commits on its own),
    script = shell(project_env, bound + f"confirm.delay('script'); {KILL}")
    # delay_on_commit() inside atomic() (a row of that transaction, so even a kill in the first on_commit
    # callback, before any callback could send it, cannot lose it),
    on_commit_method = shell(project_env, bound + "\nwith transaction.atomic():\n    Order.objects.create(id='doc')\n"
                                                  "    transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))\n"
                                                  "    confirm.delay_on_commit('doc')\n")
    # and transaction.on_commit(lambda: .delay()) killed the same way, between the commit and its callback
    callback = shell(project_env, bound + "\nwith transaction.atomic():\n    Order.objects.create(id='cb')\n"
                                          "    transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))\n"
                                          "    transaction.on_commit(lambda: confirm.delay('cb'))\n")
    assert [p.returncode for p in (script, on_commit_method, callback)] == [-9, -9, -9], callback.stderr[-2000:]
    assert sorted(query(db, "SELECT id FROM orders_order")) == [("cb",), ("doc",)]
    # When the relay and a real worker run
    start_worker()
    relay_once(project_env)
    # Then the script's task and the delay_on_commit task each run once; the on_commit callback's task is lost,
    # as docs/django.md says (a crash between the commit and the callback), while its order committed
    confirmed = "SELECT count(*) FROM orders_notification WHERE order_id IN ('confirmed:script', 'confirmed:doc')"
    assert wait_for(db, confirmed, 2) == 2, (tmp_path / "worker.log").read_text()[-3000:]
    assert sorted(query(db, "SELECT order_id FROM orders_notification")) == [("confirmed:doc",), ("confirmed:script",)]
    assert query(db, "SELECT count(*) FROM outbox_messages WHERE published_at_ms IS NULL") == [(0,)]


def test_the_projects_own_test_cases_write_the_test_database_never_the_developers(project_env: dict[str, str]) -> None:
    db = Path(project_env["SHOP_DB_PATH"])
    manage(project_env, "migrate", "--no-input")
    # Given the developer's database holding an order and a pending task row (a shell's .delay(), committed)
    out = shell(project_env, "from orders.models import Order; from orders.tasks import confirm; "
                             "Order.objects.create(id='dev-1'); confirm.delay('dev-1')")
    assert out.returncode == 0, out.stderr[-3000:]
    before = query(db, "SELECT seq, type, published_at_ms FROM outbox_messages")
    assert [row[1:] for row in before] == [("orders.confirm", None)]
    # When the team runs its TestCase and TransactionTestCase (orders/tests.py) with Django's own test runner:
    # the view under ATOMIC_REQUESTS, enqueued_tasks/run_enqueued_tasks, run_pending with no outbox configured
    # for tests (a run_pending on the developer's database would also run the dev-1 row and fail the test)
    result = subprocess.run([sys.executable, "manage.py", "test", "orders", "-v", "2"], cwd=HERE, env=project_env,
                            capture_output=True, text=True, timeout=300)
    # Then every test passed on the test database Django created and destroyed
    report = result.stderr
    assert result.returncode == 0, report[-4000:]
    for name in ("test_the_views_task_is_enqueued_in_the_test_transaction_and_runs_here",
                 "test_a_request_that_fails_leaves_neither_its_order_nor_its_task",
                 "test_run_pending_delivers_the_event_and_runs_the_task_on_the_test_database",
                 "test_a_request_that_fails_commits_nothing_to_relay"):
        assert f"{name} (orders.tests." in report and f"{name}) ... ok" in report, report[-4000:]
    assert "Ran 4 tests" in report and f"Creating test database for alias 'default' ('{db}-test')" in report
    assert not Path(f"{db}-test").exists()
    # and the developer's database is as it was: its row still pending, no order or effect of the tests
    assert query(db, "SELECT seq, type, published_at_ms FROM outbox_messages") == before
    assert query(db, "SELECT id FROM orders_order") == [("dev-1",)]
    assert query(db, "SELECT count(*) FROM orders_notification") == [(0,)]
    assert query(db, "SELECT count(*) FROM outbox_inbox") == [(0,)]
