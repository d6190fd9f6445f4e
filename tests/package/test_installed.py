"""The wheel as a user installs it: a fresh virtualenv per extra, commands run from an empty project directory.

Each test is what a new user does first with that extra: import it and ask ``outbox --help``; a consumer
processing one event on SQLite with the library's testing helpers; the README's Flask and Django quick-starts,
copied from README.md into files; Postgres through psycopg2 and psycopg 3; a real broker (Redis, RabbitMQ) that
the relay publishes to and a real worker consumes from. ``pip install "celery-outbox[django]" "Django>=6,<7"``
must resolve.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import RABBITMQ_URL, REDIS_URL, scratch_database
from tests.package import readme
from tests.package.conftest import Dist, Venv, VenvFactory, interpreter, need, pip_env
from tests.services import require_service
from tests.support.workers import stop_process

pytestmark = pytest.mark.slow

DEPLOYMENT = ("orders", "relay", "consumers", "celeryconfig", "devtools", "chaos", "bench", "examples", "tests")
OPTIONAL = ("flask", "flask_sqlalchemy", "django", "redis", "psycopg2", "psycopg", "opentelemetry", "gunicorn")

IMPORT_PROBE = r"""
import json, os, sys, threading
deployment, optional = json.loads(sys.argv[1])
before = set(os.listdir(".")) | set(os.listdir(os.environ["HOME"]))
import celery_outbox, celery_outbox.cli, celery_outbox.testing
from importlib.metadata import distribution
public = [name for name in celery_outbox.__all__ if not hasattr(celery_outbox, name)]
files = {str(f).split("/")[0] for f in distribution("celery-outbox").files}
print(json.dumps({
    "file": celery_outbox.__file__,
    "deployment": sorted(m for m in sys.modules if m.split(".")[0] in deployment),
    "optional": sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in optional}),
    "threads": threading.active_count(),
    "new_files": sorted(set(os.listdir(".")) | set(os.listdir(os.environ["HOME"])) - before),
    "missing_public": public,
    "top": sorted(f for f in files if not f.endswith(".dist-info") and f not in ("..", "bin")),
}))
"""

# A user's first app: its own table, one consumer, the outbox on its engine; the URLs from its environment.
SHOP = '''\
import os

from celery import Celery
from sqlalchemy import String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from celery_outbox import Outbox


class Base(DeclarativeBase):
    pass


class Shipment(Base):
    __tablename__ = "shipments"
    order_id: Mapped[str] = mapped_column(String(64), primary_key=True)


engine = create_engine(os.environ["SHOP_DATABASE_URL"])
app = Celery("shop", broker=os.environ.get("SHOP_BROKER_URL", "memory://"))
outbox = Outbox(app, engine=engine)


@outbox.consumer("OrderPlaced", name="ship")
def ship(session, event):
    session.add(Shipment(order_id=event.payload["order_id"]))
'''

# The user's own test of it: place an order, run the consumer with the testing helpers, deliver it twice.
SHOP_TEST = '''\
import json

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from celery_outbox import Event, Outcome
from celery_outbox.testing import InMemoryPublisher, deliver_message, run_pending
from shop import Base, Shipment, engine, outbox

Base.metadata.create_all(engine)
with Session(engine) as session, outbox.transaction(session):
    outbox.publish(session, Event("OrderPlaced", {"order_id": "o-1"}))
    session.commit()
publisher = InMemoryPublisher()
first = run_pending(outbox, publisher)
again = deliver_message(outbox, publisher.messages()[0], redelivered=True)
with Session(engine) as session:
    shipped = session.scalar(select(func.count()).select_from(Shipment))
print(json.dumps({"first": {k: [o.name for o in v] for k, v in first.items()}, "again": again.name,
                  "shipped": shipped, "later": run_pending(outbox)}))
'''


def first_use(venv: Venv, workdir: Path, env: dict[str, str]) -> dict[str, object]:
    """The shop above: migrated by ``outbox db upgrade``, one event placed and consumed, then delivered again."""
    (workdir / "shop.py").write_text(SHOP)
    (workdir / "shop_test.py").write_text(SHOP_TEST)
    venv.check(["outbox", "-A", "shop", "db", "upgrade"], cwd=workdir, env=env)
    result: dict[str, object] = json.loads(venv.check(["python", "shop_test.py"], cwd=workdir, env=env))
    return result


EXPECTED_FIRST_USE = {"first": {"ship": ["PROCESSED"]}, "again": "DUPLICATE", "shipped": 1, "later": {}}


def test_bare_install_imports_without_side_effects_and_without_the_deployment(venv_factory: VenvFactory,
                                                                               workdir: Path) -> None:
    # Given the wheel with no extra in a fresh venv
    venv: Venv = venv_factory()
    # When the package, its CLI and its testing helpers are imported from an empty directory
    probe = json.loads(venv.check(["python", "-c", IMPORT_PROBE, json.dumps([DEPLOYMENT, OPTIONAL])], cwd=workdir))
    # Then it is the installed copy, it brought in no deployment module and no optional dependency, started
    # no thread, wrote no file, names every public name, and the distribution installs one package
    assert probe["file"].startswith(str(venv.root)), probe["file"]
    assert probe["deployment"] == [] and probe["optional"] == []
    assert probe["threads"] == 1 and probe["new_files"] == [] and probe["missing_public"] == []
    assert probe["top"] == ["celery_outbox"]


def test_bare_install_cli_helps_and_asks_for_the_users_app(venv_factory: VenvFactory, workdir: Path) -> None:
    venv: Venv = venv_factory()
    helped = venv.check(["outbox", "--help"], cwd=workdir)
    assert "Usage: outbox" in helped and "relay" in helped and "dead-letters" in helped
    # With no app named anywhere, a command exits 2 with one line that says what to pass (no traceback)
    out = venv.run(["outbox", "stats"], cwd=workdir)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "-A" in out.stderr and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_a_consumer_processes_one_event_on_sqlite_with_the_testing_helpers(venv_factory: VenvFactory,
                                                                           workdir: Path) -> None:
    venv: Venv = venv_factory()
    env = venv.env(SHOP_DATABASE_URL=f"sqlite:///{workdir / 'shop.db'}")
    assert first_use(venv, workdir, env) == EXPECTED_FIRST_USE
    # and the CLI finds the app from the project's pyproject.toml
    (workdir / "pyproject.toml").write_text('[tool.celery-outbox]\napp = "shop"\n')
    stats = json.loads(venv.check(["outbox", "stats", "--json"], cwd=workdir, env=env))
    assert (stats["outbox"]["pending"], stats["inbox"]["per_consumer"]) == (0, {"ship": 1}), stats


def test_the_readme_flask_quick_start_runs_from_the_wheel(venv_factory: VenvFactory, workdir: Path) -> None:
    # Given the [flask] extra beside the user's Flask-SQLAlchemy (as the README says), and every file the README's
    # block shows copied into a new project, nothing else (Flask("shop") needs shop/__init__.py; the app imports
    # shop.models)
    venv: Venv = venv_factory("flask", "flask-sqlalchemy>=3.1")
    quick = readme.files("Adopt it (Flask + SQLAlchemy)")
    assert set(quick) == {"shop/app.py", "shop/worker.py", "shop/__init__.py", "shop/models.py"}, sorted(quick)
    for path, code in quick.items():
        readme.write(workdir, path, code)
    env = venv.env(SHOP_SQLALCHEMY_DATABASE_URI=f"sqlite:///{workdir / 'shop.db'}", SHOP_CELERY__broker_url="memory://",
                   OUTBOX_NAMESPACE="shop")
    # When the library's tables come from `flask outbox db upgrade` and the team's from its metadata,
    venv.check(["flask", "--app", "shop.app", "outbox", "db", "upgrade"], cwd=workdir, env=env)
    # and an order is placed through the view, then relayed and run with the testing helpers
    script = textwrap.dedent("""
        import json
        from sqlalchemy import func, select
        from celery_outbox.testing import run_pending
        from shop.app import create_app, db
        from shop.models import Confirmation, Notification
        web = create_app()
        with web.app_context():
            db.create_all()
        placed = web.test_client().post("/orders", json={"id": "o-1"}).status_code
        outcomes = run_pending(web.extensions["celery_outbox"])
        with web.app_context():
            counts = [db.session.scalar(select(func.count()).select_from(m)) for m in (Notification, Confirmation)]
        print(json.dumps({"placed": placed, "outcomes": {k: [o.name for o in v] for k, v in outcomes.items()},
                          "counts": counts}))
    """)
    result = json.loads(venv.check(["python", "-c", script], cwd=workdir, env=env))
    # Then the order, its event's consumer and its task each took effect once
    assert result == {"placed": 201, "outcomes": {"notify": ["PROCESSED"], "shop.confirm": ["PROCESSED"]},
                      "counts": [1, 1]}
    # And `outbox` finds the app through FLASK_APP
    stats = json.loads(venv.check(["outbox", "stats", "--json"], cwd=workdir, env={**env, "FLASK_APP": "shop.app"}))
    assert (stats["outbox"]["pending"], stats["inbox"]["per_consumer"]) == (0, {"notify": 1}), stats


DJANGO_SETTINGS = '''\
import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "django-insecure-quick-start"
DEBUG = False
ALLOWED_HOSTS = ["testserver"]
MIDDLEWARE = []
ROOT_URLCONF = "proj.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "db.sqlite3",
                         "TEST": {"NAME": str(BASE_DIR / "test.sqlite3")}}}

'''

DJANGO_FILES = {
    "manage.py": '''\
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
''',
    "proj/__init__.py": 'from .celery import app as celery_app\n\n__all__ = ("celery_app",)\n',
    "proj/urls.py": 'from django.urls import path\n\nfrom orders.views import place\n\nurlpatterns = [path("orders", place)]\n',
    "orders/__init__.py": "",
    "orders/apps.py": '''\
from django.apps import AppConfig


class OrdersConfig(AppConfig):
    name = "orders"

    def ready(self):
        from orders.consumers import notify
        from proj.celery import outbox

        outbox.include(notify)
''',
    "orders/models.py": '''\
from django.db import models


class Order(models.Model):
    id = models.CharField(max_length=64, primary_key=True)


class Notification(models.Model):
    order_id = models.CharField(max_length=64)
''',
    "orders/consumers.py": '''\
from celery_outbox.contrib.django import idempotent_consumer
from orders.models import Notification


@idempotent_consumer("OrderPlaced", name="notify")
def notify(envelope):
    Notification.objects.create(order_id=envelope.payload["order_id"])
''',
    "orders/tasks.py": '''\
from celery import shared_task

from orders.models import Notification


@shared_task(name="orders.confirm")
def confirm(order_id):
    Notification.objects.create(order_id=f"confirmed:{order_id}")
''',
    "orders/tests.py": '''\
from django.test import TestCase, TransactionTestCase

from celery_outbox import Outcome
from celery_outbox.contrib.django.testing import enqueued_tasks, run_enqueued_tasks
from celery_outbox.testing import run_pending
from orders.models import Notification
from proj.celery import outbox


class InTheTestTransaction(TestCase):
    def test_the_views_task_is_a_row_of_the_request(self):
        self.assertEqual(self.client.post("/orders", {"id": "t-1"}, content_type="application/json").status_code, 201)
        [message] = enqueued_tasks(outbox)
        self.assertEqual(message.headers["task"], "orders.confirm")
        self.assertEqual([r.state for r in run_enqueued_tasks(outbox)], ["SUCCESS"])


class Committed(TransactionTestCase):
    def test_run_pending_delivers_the_event_and_runs_the_task(self):
        self.assertEqual(self.client.post("/orders", {"id": "c-1"}, content_type="application/json").status_code, 201)
        self.assertEqual(run_pending(outbox), {"notify": [Outcome.PROCESSED], "orders.confirm": [Outcome.PROCESSED]})
        self.assertEqual(sorted(Notification.objects.values_list("order_id", flat=True)), ["c-1", "confirmed:c-1"])
        self.assertEqual(run_pending(outbox), {})
''',
}

# What the README's views.py leaves to the user: the imports of its own names.
DJANGO_VIEW_IMPORTS = ("import json\n\nfrom django.http import JsonResponse\n\n"
                       "from orders.models import Order\nfrom orders.tasks import confirm\n")


def test_the_readme_django_quick_start_runs_from_the_wheel(venv_factory: VenvFactory, workdir: Path) -> None:
    # Given the [django] extra only (no redis, no postgres driver), a project in Celery's Django layout whose
    # outbox lines, proj/celery.py and orders/views.py are the README's
    venv: Venv = venv_factory("django")
    quick = readme.files("Adopt it (Django)")
    assert set(quick) == {"proj/settings.py", "proj/celery.py", "orders/views.py"}, sorted(quick)
    for path, code in DJANGO_FILES.items():
        readme.write(workdir, path, code)
    readme.write(workdir, "proj/settings.py", DJANGO_SETTINGS + quick["proj/settings.py"])
    readme.write(workdir, "proj/celery.py", quick["proj/celery.py"])
    readme.write(workdir, "orders/views.py", DJANGO_VIEW_IMPORTS + quick["orders/views.py"])
    env = venv.env(SHOP_BROKER_URL="memory://", SHOP_NAMESPACE="shop")
    # When the team makes its migrations, migrates, checks and runs its own tests
    for step in (["makemigrations", "orders"], ["migrate"], ["check"], ["test", "orders", "-v", "2"]):
        out = venv.run(["python", "manage.py", *step], cwd=workdir, env=env)
        # Then every step succeeds: both test cases ran the view's event and task through the outbox
        assert out.returncode == 0, f"manage.py {' '.join(step)}:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    assert "Ran 2 tests" in out.stderr and "OK" in out.stderr, out.stderr[-3000:]
    # And an order placed on the project's own database leaves its event and its task as two pending rows,
    # which the outbox commands see: through manage.py, and bare through DJANGO_SETTINGS_MODULE
    place = ('from django.test import Client; '
             'print(Client().post("/orders", {"id": "d-1"}, content_type="application/json").status_code)')
    placed = venv.check(["python", "manage.py", "shell", "-c", place], cwd=workdir, env=env)
    assert placed.splitlines()[-1] == "201", placed
    stats = json.loads(venv.check(["python", "manage.py", "outbox", "stats", "--json"], cwd=workdir, env=env))
    assert stats["outbox"]["pending"] == 2, stats
    bare = venv.check(["outbox", "stats", "--json"], cwd=workdir, env={**env, "DJANGO_SETTINGS_MODULE": "proj.settings"})
    assert json.loads(bare)["outbox"]["pending"] == 2, bare


@pytest.mark.postgres
@pytest.mark.parametrize(("extra", "driver"), [("psycopg2", "psycopg2"), ("psycopg", "psycopg")])
def test_each_postgres_driver_alone_runs_a_consumer(venv_factory: VenvFactory, workdir: Path, extra: str,
                                                    driver: str) -> None:
    # Given the wheel with one Postgres driver's extra, and the other driver absent
    venv: Venv = venv_factory(extra)
    other = "psycopg" if driver == "psycopg2" else "psycopg2"
    absent = venv.run(["python", "-c", f"import {other}"], cwd=workdir)
    assert absent.returncode != 0, f"{other} is installed too"
    with scratch_database("outbox_pkg") as url:
        env = venv.env(SHOP_DATABASE_URL=f"postgresql+{driver}://" + url.split("://", 1)[1])
        # When the shop migrates and consumes one event, Then it did, once, on that driver
        assert first_use(venv, workdir, env) == EXPECTED_FIRST_USE
        used = venv.check(["python", "-c", "from shop import engine; print(engine.dialect.driver)"], cwd=workdir, env=env)
        assert used.strip() == driver


def relay_and_consume(venv: Venv, workdir: Path, env: dict[str, str]) -> int:
    """The shop on a real broker: `outbox check`, one event placed, `outbox relay --once`, a real worker consumes."""
    (workdir / "shop.py").write_text(SHOP)
    venv.check(["outbox", "-A", "shop", "db", "upgrade"], cwd=workdir, env=env)
    venv.check(["outbox", "-A", "shop", "check"], cwd=workdir, env=env)
    place = ("from sqlalchemy.orm import Session\nfrom celery_outbox import Event\nfrom shop import Base, engine, outbox\n"
             "Base.metadata.create_all(engine)\nwith Session(engine) as s, outbox.transaction(s):\n"
             "    outbox.publish(s, Event('OrderPlaced', {'order_id': 'o-1'}))\n    s.commit()\n")
    venv.check(["python", "-c", place], cwd=workdir, env=env)
    venv.check(["outbox", "-A", "shop", "relay", "--once"], cwd=workdir, env=env)
    count = ("from sqlalchemy import func, select\nfrom shop import Shipment, engine\n"
             "with engine.connect() as c: print(c.scalar(select(func.count()).select_from(Shipment)))\n")
    log = (workdir / "worker.log").open("wb")
    worker = subprocess.Popen([str(venv.bin("celery")), "-A", "shop", "worker", "-P", "solo", "--without-gossip",
                               "--without-mingle", "--without-heartbeat"], cwd=workdir, env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        shipped = 0
        while time.monotonic() < deadline and worker.poll() is None:
            shipped = int(venv.check(["python", "-c", count], cwd=workdir, env=env))
            if shipped:
                break
            time.sleep(0.5)
    finally:
        stop_process(worker, timeout_s=20, group=False)
        log.close()
    assert shipped == 1, (workdir / "worker.log").read_text()[-4000:]
    return shipped


@pytest.mark.redis
@pytest.mark.workers
def test_the_redis_extra_relays_to_a_real_redis_and_a_worker_consumes(venv_factory: VenvFactory, workdir: Path) -> None:
    require_service("Redis", "127.0.0.1", 6379)
    venv: Venv = venv_factory("redis")
    env = venv.env(SHOP_DATABASE_URL=f"sqlite:///{workdir / 'shop.db'}", SHOP_BROKER_URL=REDIS_URL.rsplit("/", 1)[0] + "/5",
                   OUTBOX_NAMESPACE=f"pkg{uuid.uuid4().hex[:8]}")
    assert relay_and_consume(venv, workdir, env) == 1


@pytest.mark.rabbitmq
@pytest.mark.workers
def test_the_rabbitmq_extra_relays_to_a_real_rabbitmq_and_a_worker_consumes(venv_factory: VenvFactory, workdir: Path) -> None:
    require_service("RabbitMQ", "127.0.0.1", 5672)
    venv: Venv = venv_factory("rabbitmq")
    env = venv.env(SHOP_DATABASE_URL=f"sqlite:///{workdir / 'shop.db'}", SHOP_BROKER_URL=RABBITMQ_URL,
                   OUTBOX_NAMESPACE=f"pkg{uuid.uuid4().hex[:8]}")
    assert relay_and_consume(venv, workdir, env) == 1


def test_the_django_extra_resolves_with_django_6(dist: Dist, tmp_path: Path) -> None:
    # Django 6 needs Python >= 3.12: ask that interpreter's pip, installing nothing
    python = interpreter("3.13") or interpreter("3.12")
    need("python3.12 or python3.13 (Django 6 needs Python >= 3.12)", python is not None)
    assert python is not None
    report = tmp_path / "report.json"
    out = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", "--report",
                          str(report), f"{dist.wheel}[django]", "Django>=6,<7"], env=pip_env(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert chosen["django"].startswith("6."), chosen
    assert "celery-outbox" in chosen

