"""The same verbs on the front doors ``Outbox`` and ``FlaskOutbox`` (``DjangoOutbox``'s are
tests/django/test_django_front_door.py): ``consumer``, ``task``, ``periodic`` declared the same way, by
``declare()``; ``publish``, ``cancel``, ``transaction``, ``enqueue`` given the framework's own session object
(a ``Session``; Flask-SQLAlchemy's ``db.session``, a ``scoped_session``). docs/api.md's table of verbs and
front doors names these tests.

The ``FlaskOutbox`` is declared at import of this module, before any Flask app exists: a task, a consumer and a
beat entry of a team's package must be importable by the rest of the code, not built inside ``create_app``.
"""

from __future__ import annotations

import ast
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, scoped_session

from celery_outbox import Envelope, Event, Outbox, Outcome, migrate_database
from celery_outbox.celery import beat
from celery_outbox.contrib.flask import FlaskOutbox
from celery_outbox.settings import Settings
from celery_outbox.testing import run_pending


class Base(DeclarativeBase):
    pass


class Note(Base):
    __tablename__ = "front_door_notes"
    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)


TASK = "front_door.write_note"
BEAT_ENTRY = "front-door-every-minute"


def declare(front: Outbox | FlaskOutbox) -> Any:
    """The declarations a team's package makes at import, the same on every front door; returns the task."""

    @front.consumer("NoteAdded", name="front-door-notes")
    def on_note(session: Session, event: Envelope) -> None:
        session.add(Note(id=f"consumer:{event.payload['id']}"))

    @front.task(name=TASK)  # type: ignore[untyped-decorator]
    def write_note(session: Session, note_id: str) -> None:
        session.add(Note(id=f"task:{note_id}"))

    front.periodic(BEAT_ENTRY, TASK, 60.0, args=("tick",))
    return write_note


db = SQLAlchemy(model_class=Base)
flask_front = FlaskOutbox()
flask_task = declare(flask_front)  # at import: no Flask app, no Celery app yet


@dataclass
class Door:
    """One front door, bound to a fresh database: the verbs' object, the outbox behind it, the declared task,
    and ``session()``: the session object the framework hands the application."""

    front: Outbox | FlaskOutbox
    outbox: Outbox
    task: Any
    scoped: scoped_session[Any] | None = None
    app: Flask | None = None

    @contextmanager
    def session(self) -> Iterator[Any]:
        if self.app is None:
            with self.outbox.sessions()() as s:
                yield s
            return
        assert self.scoped is not None
        with self.app.app_context():
            yield self.scoped
            self.scoped.remove()

    def notes(self) -> list[str]:
        with self.outbox.sessions()() as s:
            return sorted(s.scalars(sa.select(Note.id)))

    def pending(self) -> int:
        with self.outbox.sessions()() as s:
            outbox = self.outbox.tables.table(self.outbox.tables.outbox)
            return int(s.scalar(sa.select(sa.func.count()).select_from(outbox)
                                .where(outbox.c.published_at_ms.is_(None))) or 0)


@pytest.fixture(params=["Outbox", "FlaskOutbox"])
def door(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Door]:
    url = f"sqlite:///{tmp_path / 'front.db'}"
    migrate_database(url)
    engine = sa.create_engine(url)
    Base.metadata.create_all(engine)
    engine.dispose()
    if request.param == "Outbox":
        celery = Celery(f"plain{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
        plain = Outbox(celery, settings=Settings(database_url=url))
        yield Door(front=plain, outbox=plain, task=declare(plain))
        plain.close()
        return
    app = Flask(f"front{uuid.uuid4().hex[:6]}")
    app.config.update(SQLALCHEMY_DATABASE_URI=url, CELERY={"broker_url": "memory://localhost/"})
    db.init_app(app)
    outbox = flask_front.init_app(app, db=db)
    yield Door(front=flask_front, outbox=outbox, task=flask_task, scoped=db.session, app=app)
    with app.app_context():
        db.engine.dispose()


def test_consumer(door: Door) -> None:
    # Given the consumer declared by declare(), When an event for it is published and the relay runs
    with door.session() as s:
        door.front.publish(s, Event("NoteAdded", {"id": "n-1"}))
        s.commit()
    # Then the consumer ran once on this front door's outbox
    assert run_pending(door.outbox) == {"front-door-notes": [Outcome.PROCESSED]}
    assert door.notes() == ["consumer:n-1"]


def test_publish(door: Door) -> None:
    # Given the framework's session object, When an event is published and the work rolled back
    with door.session() as s:
        door.front.publish(s, Event("NoteAdded", {"id": "n-1"}))
        s.rollback()
    assert door.pending() == 0
    # When it is published and committed, Then its row is pending for the relay
    with door.session() as s:
        row = door.front.publish(s, Event("NoteAdded", {"id": "n-2"}))
        s.commit()
        assert row.type == "NoteAdded"
    assert door.pending() == 1


def test_task(door: Door) -> None:
    # Given the idempotent task declared by declare() (a proxy on FlaskOutbox, resolved at use)
    assert door.task.name == TASK and TASK in door.outbox.idempotent_tasks()
    # When it is sent inside a transaction that commits, and the relay and the worker run
    with door.session() as s, door.front.transaction(s):
        result = door.task.delay("n-1")
        s.commit()
    assert run_pending(door.outbox) == {TASK: [Outcome.PROCESSED]}
    # Then its effect is written once, and a second run of the same task id has none
    door.task.apply(args=("n-1",), task_id=result.id)
    assert door.notes() == ["task:n-1"]


def test_cancel(door: Door) -> None:
    # Given a task committed to the outbox and not yet relayed
    with door.session() as s, door.front.transaction(s):
        task_id = door.task.delay("n-1").id
        s.commit()
    # When it is cancelled with the framework's session object (db.session is a scoped_session)
    with door.session() as s:
        cancelled = door.front.cancel(s, task_id)
        s.commit()
    # Then its row is gone and the relay has nothing to send
    assert str(cancelled.message_id) == task_id and cancelled.type == TASK
    assert door.pending() == 0
    assert run_pending(door.outbox) == {}


def test_periodic(door: Door) -> None:
    # Given the beat entry declared by declare(), Then the outbox's Celery app has it, as an outbox tick
    entry = door.outbox.app.conf.beat_schedule[BEAT_ENTRY]
    assert entry["task"] == TASK and entry["args"] == ("tick",)
    assert entry["options"]["headers"][beat.BEAT_HEADER] == BEAT_ENTRY


def test_transaction(door: Door) -> None:
    # Given the task sent inside outbox.transaction(session), When the work rolls back, Then nothing is pending
    with door.session() as s, door.front.transaction(s) as bound:
        assert isinstance(bound, Session)
        door.task.delay("n-1")
        s.rollback()
    assert door.pending() == 0
    # When it commits, Then the task is one pending row, sent by the relay after the commit
    with door.session() as s, door.front.transaction(s):
        door.task.delay("n-2")
        s.commit()
    assert door.pending() == 1


def test_enqueue(door: Door) -> None:
    # Given two enqueues of the task with one dedup key, in the framework's session
    with door.session() as s:
        first = door.front.enqueue(s, door.task.s("n-1"), dedup_key="note:n-1")
        second = door.front.enqueue(s, door.task.s("n-1"), dedup_key="note:n-1")
        s.commit()
    # Then one row is pending, and both results name its task id
    assert door.pending() == 1 and first.id == second.id
    assert run_pending(door.outbox) == {TASK: [Outcome.PROCESSED]}
    assert door.notes() == ["task:n-1"]


ROOT = Path(__file__).resolve().parents[2]
VERBS = ("consumer", "task", "publish", "cancel", "periodic", "transaction", "enqueue")
DOORS = ("Outbox", "FlaskOutbox", "DjangoOutbox")


def test_the_api_table_names_a_test_per_cell() -> None:
    # Given docs/api.md's table of verbs (rows) and front doors (columns)
    lines = (ROOT / "docs" / "api.md").read_text().splitlines()
    start = lines.index("| verb | `Outbox` | `FlaskOutbox` | `DjangoOutbox` |")
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    # Then every verb has a row, and each cell names a test that exists, for its own verb and door
    assert tuple(rows) == VERBS
    defined: dict[str, set[str]] = {}
    for verb, cells in rows.items():
        for door, cell in zip(DOORS, cells, strict=True):
            named = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)(?:\[(\w+)\])?`", cell)
            assert len(named) == 1, (verb, door, cell)
            path, test, param = named[0]
            assert test == f"test_{verb}" and param in (door, "")
            if path not in defined:
                tree = ast.parse((ROOT / path).read_text())
                defined[path] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert test in defined[path], (path, test)
