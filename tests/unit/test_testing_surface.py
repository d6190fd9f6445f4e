"""The testing surface on SQLAlchemy (``celery_outbox.testing``): ``run_pending`` runs task rows instead of
marking them unrun, ``enqueued_tasks`` / ``run_enqueued_tasks`` (the twin of the Django helpers), what the
in-memory publisher got, ``Outbox.close()``, and the pytest fixtures loaded through the ``pytest11`` entry point."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Envelope, Event, ManualClock, Outbox, Outcome, Settings, migrate_database
from celery_outbox.testing import InMemoryPublisher, drain, enqueued_tasks, run_enqueued_tasks, run_pending


class Shop:
    """An app with an event consumer, a plain task, a task that sends a task, and a failing task."""

    def __init__(self, url: str) -> None:
        self.engine = sa.create_engine(url)
        self.sessions = sessionmaker(self.engine)
        self.queue = f"shop-{uuid.uuid4().hex[:8]}"
        app = Celery("shop", broker="memory://localhost/", set_as_current=False)
        app.conf.task_routes = {"shop.*": {"queue": self.queue}}
        self.outbox = Outbox(app, engine=self.engine, settings=Settings.from_env({}), clock=ManualClock())
        self.ran: list[tuple[str, Any]] = []

        @self.outbox.consumer("OrderPlaced", name="notify")
        def notify(session: Session, event: Envelope) -> None:
            self.ran.append(("notify", event.payload["id"]))

        @app.task(name="shop.mail", shared=False)  # type: ignore[untyped-decorator]
        def mail(order_id: str) -> str:
            self.ran.append(("mail", order_id))
            return order_id

        @app.task(name="shop.place", shared=False)  # type: ignore[untyped-decorator]
        def place(order_id: str) -> None:
            self.ran.append(("place", order_id))
            mail.delay(order_id)  # a task that sends a task

        @app.task(name="shop.broken", shared=False)  # type: ignore[untyped-decorator]
        def broken() -> None:
            raise ValueError("broken on purpose")

        self.mail, self.place, self.broken = mail, place, broken

    def pending(self) -> int:
        model = self.outbox.tables.outbox
        with self.sessions() as s:
            return int(s.execute(sa.select(sa.func.count()).select_from(model)
                                 .where(model.published_at_ms.is_(None))).scalar_one())


@pytest.fixture
def shop(tmp_path: Path) -> Any:
    url = f"sqlite:///{tmp_path / 'shop.db'}"
    migrate_database(url)
    built = Shop(url)
    yield built
    built.engine.dispose()


def test_run_pending_runs_task_rows_with_the_events_and_never_marks_one_unrun(shop: Shop) -> None:
    # Given an event and a task committed together
    with shop.sessions.begin() as s, shop.outbox.transaction(s):
        shop.outbox.publish(s, Event("OrderPlaced", {"id": "o-1"}))
        shop.mail.delay("o-1")
    # When run_pending runs, Then the consumer and the task both ran, once, and nothing is left pending
    publisher = InMemoryPublisher()
    assert run_pending(shop.outbox, publisher) == {"notify": [Outcome.PROCESSED], "shop.mail": [Outcome.PROCESSED]}
    assert sorted(shop.ran) == [("mail", "o-1"), ("notify", "o-1")] and shop.pending() == 0
    # And the publisher shows what the broker got: one event delivery, one task message
    assert [m.consumer for m in publisher.events()] == ["notify"]
    assert [m.headers["task"] for m in publisher.tasks()] == ["shop.mail"]
    assert [m.message_id for m in publisher.messages()] == [m.message_id for m in publisher.published]
    # And a second call has nothing to do
    assert run_pending(shop.outbox, publisher) == {} and len(shop.ran) == 2


def test_run_pending_runs_everything_drained_before_raising_a_tasks_failure(shop: Shop) -> None:
    # Given a failing task committed before a good one
    with shop.sessions.begin() as s, shop.outbox.transaction(s):
        shop.broken.delay()
        shop.mail.delay("o-2")
    # When run_pending runs, Then the failure is raised, after the good task ran
    with pytest.raises(ValueError, match="broken on purpose"):
        run_pending(shop.outbox)
    assert shop.ran == [("mail", "o-2")] and shop.pending() == 0


def test_enqueued_tasks_and_run_enqueued_tasks_on_committed_rows(shop: Shop) -> None:
    # Given a task committed by a view (its task sends another task when it runs)
    with shop.sessions.begin() as s, shop.outbox.transaction(s):
        result = shop.place.delay("o-3")
    # Then enqueued_tasks shows it as the relay would publish it, marking nothing
    [message] = enqueued_tasks(shop.outbox)
    assert message.headers["task"] == "shop.place" and message.message_id == result.id
    assert enqueued_tasks(shop.outbox) == [message] and shop.ran == []
    # When run_enqueued_tasks runs, Then the task ran, then the task it sent (next round), each once
    results = run_enqueued_tasks(shop.outbox)
    assert len(results) == 2 and results[0].id == result.id and all(r.successful() for r in results)
    assert shop.ran == [("place", "o-3"), ("mail", "o-3")]
    assert enqueued_tasks(shop.outbox) == [] and shop.pending() == 0 and drain(shop.outbox).published == []


def test_run_enqueued_tasks_inside_a_session_that_never_commits(shop: Shop) -> None:
    # Given a test that keeps everything in one session and rolls it back at the end
    with shop.sessions() as s:
        with shop.outbox.transaction(s):
            shop.place.delay("o-4")
        # Then its uncommitted row is visible through the session only
        assert [m.headers["task"] for m in enqueued_tasks(shop.outbox, session=s)] == ["shop.place"]
        # When its tasks run through the session, Then what they send is a row of the same session, run next
        assert len(run_enqueued_tasks(shop.outbox, session=s)) == 2
        assert shop.ran == [("place", "o-4"), ("mail", "o-4")]
        assert enqueued_tasks(shop.outbox, session=s) == []
        s.rollback()
    # And the rollback took every row with it
    assert enqueued_tasks(shop.outbox) == [] and shop.pending() == 0


def test_close_releases_the_connections_of_an_engine_it_built_and_never_a_given_one(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'own.db'}"
    migrate_database(url)
    # Given an outbox that built its engine from database_url and used it
    own = Outbox(Celery("own", broker="memory://", set_as_current=False), settings=Settings.from_env({}, database_url=url))
    engine = own.sessions().kw["bind"]
    with own.sessions()() as s:
        s.execute(sa.select(1))
    assert engine.pool.checkedin() == 1
    # When it is closed (twice: idempotent), Then its pool holds no connection; a later use reconnects
    own.close()
    own.close()
    assert engine.pool.checkedin() == 0
    with own as again, again.sessions()() as s:
        assert s.execute(sa.select(1)).scalar_one() == 1
    # And an engine the caller gave stays the caller's
    given = sa.create_engine(url)
    with given.connect() as c:
        c.execute(sa.select(1))
    Outbox(Celery("given", broker="memory://", set_as_current=False), engine=given,
           settings=Settings.from_env({})).close()
    assert given.pool.checkedin() == 1  # type: ignore[attr-defined]
    given.dispose()


PLUGIN_USER = '''
import sqlalchemy as sa
import pytest
from celery import Celery
from celery_outbox import Outbox, Outcome, Settings, migrate_database


@pytest.fixture
def outbox(tmp_path):
    url = f"sqlite:///{tmp_path / 'user.db'}"
    migrate_database(url)
    app = Celery("user", broker="memory://", set_as_current=False)
    app.conf.task_routes = {"user.*": {"queue": "user"}}
    box = Outbox(app, settings=Settings.from_env({}, database_url=url))
    box.ran = []

    @app.task(name="user.hello", shared=False)
    def hello(name):
        box.ran.append(name)

    box.hello = hello
    return box


def test_fixtures_come_from_the_installed_plugin(outbox_publisher, manual_clock, outbox_tasks, outbox):
    manual_clock.advance(5)
    assert manual_clock.now_ms() > 0 and outbox_publisher.messages() == []
    outbox.hello.delay("ann")                    # no transaction open: a row of its own
    assert [m.headers["task"] for m in outbox_tasks.enqueued()] == ["user.hello"]
    assert outbox_tasks.run_pending() == {"user.hello": [Outcome.PROCESSED]}
    assert outbox.ran == ["ann"] and [m.headers["task"] for m in outbox_publisher.tasks()] == ["user.hello"]
'''


def test_the_pytest_fixtures_load_through_the_entry_point_with_no_conftest(tmp_path: Path) -> None:
    # Given a user's test file using the fixtures, with no conftest and no pytest_plugins line
    (tmp_path / "test_user.py").write_text(textwrap.dedent(PLUGIN_USER))
    # When pytest runs it in its own directory, Then every fixture resolves and the test passes
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error",
                          "test_user.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "1 passed" in out.stdout
