"""``task.delay()`` with no transaction open (a script, a shell, code after the commit): the default mode
``own_transaction`` writes the row in a short transaction of its own; ``raise`` stays the strict mode.

SQLite and Postgres (``any_sessions``) where the idiom allows both; the relay is
``celery_outbox.testing.drain`` with the in-memory publisher. The same idiom under a SIGKILL between the
commit and any publish is in tests/chaos/test_enqueue_idioms.py.
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import DatabaseError, ManualClock, Outbox, Settings, Tables, ValidationError
from celery_outbox.testing import drain
from tests.tasks.test_enqueue import TaskApp


@pytest.fixture
def queue() -> str:
    return f"own-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def tasks(any_sessions: sessionmaker[Session], clock: ManualClock, tables: Tables, queue: str) -> TaskApp:
    return TaskApp(any_sessions, clock, tables, queue)  # the default settings: own_transaction


def test_the_default_mode_is_own_transaction() -> None:
    assert Settings().enqueue_outside_transaction == "own_transaction"
    assert Settings.from_env({"OUTBOX_ENQUEUE_OUTSIDE_TRANSACTION": "own_transaction"}) == Settings()


def test_a_delay_with_no_transaction_commits_its_own_row_and_sends_nothing_directly(tasks: TaskApp) -> None:
    # Given no transaction open (a script), When a task is sent
    result = tasks.mail.delay("a@example.com", subject="hi")
    # Then its row is committed (another session sees it), pending, and nothing went to the broker directly
    [row] = tasks.rows()
    assert str(row.message_id) == result.id and row.type == "enq.mail" and row.published_at_ms is None
    assert tasks.broker_messages() == []
    # When the relay runs, Then it publishes the task as Celery built it, once
    [m] = drain(tasks.outbox).published
    assert m.headers["id"] == result.id and m.headers["task"] == "enq.mail" and m.routing_key == tasks.queue
    assert drain(tasks.outbox).published == []


def test_after_the_commit_each_delay_is_its_own_row(tasks: TaskApp) -> None:
    # Given a transaction that committed (the code after `with Session.begin()`), When two tasks are sent
    with tasks.sessions.begin() as s:
        s.execute(sa.select(1))
    first, second = tasks.step.delay(1), tasks.step.delay(2)
    # Then both are rows, published in order
    assert [str(r.message_id) for r in tasks.rows()] == [first.id, second.id]
    assert [m.message_id for m in drain(tasks.outbox).published] == [first.id, second.id]


@pytest.mark.postgres
def test_not_atomic_with_an_unbound_session_that_rolls_back(pg_sessions: sessionmaker[Session], clock: ManualClock,
                                                            tables: Tables, queue: str) -> None:
    # Given a session that wrote an order but is NOT bound to the outbox (documented: not atomic)
    t = TaskApp(pg_sessions, clock, tables, queue)
    orders = sa.Table(f"own_tx_orders_{uuid.uuid4().hex[:8]}", sa.MetaData(), sa.Column("id", sa.String(20)))
    engine = pg_sessions.kw["bind"]
    orders.create(engine)
    try:
        with t.sessions() as s:
            s.execute(orders.insert().values(id="o-1"))
            # When it sends a task and then rolls back
            result = t.mail.delay("a@example.com")
            s.rollback()
        # Then the order is gone but the task's row stays, committed on its own: bind the session
        # (outbox.transaction) to make them one commit
        with t.sessions() as s:
            assert s.execute(sa.select(sa.func.count()).select_from(orders)).scalar_one() == 0
        assert [str(r.message_id) for r in t.rows()] == [result.id]
    finally:
        orders.drop(engine)


def test_a_chosen_task_id_an_outbox_row_holds_is_refused(tasks: TaskApp) -> None:
    # Given a row with task id X committed on its own
    task_id = str(uuid.uuid4())
    tasks.mail.apply_async(("a@example.com",), task_id=task_id)
    # When X is chosen again outside a transaction, Then it is refused and nothing more is written
    with pytest.raises(ValidationError, match="already holds"):
        tasks.mail.apply_async(("b@example.com",), task_id=task_id)
    assert [str(r.message_id) for r in tasks.rows()] == [task_id]


def test_a_database_that_is_down_is_one_clear_error_without_its_password(tables: Tables, queue: str) -> None:
    # Given an outbox whose database refuses connections
    app = Celery("down", broker="memory://localhost/down", set_as_current=False)
    app.conf.update(task_routes={"down.t": {"queue": queue}})
    url = "postgresql://shop:s3cret-pw@127.0.0.1:1/shop"
    outbox = Outbox(app, settings=Settings(database_url=url, db_connect_timeout_s=2))

    @app.task(name="down.t", shared=False)  # type: ignore[untyped-decorator]
    def t() -> None:
        pass

    # When a script sends a task, Then one line says so, naming the task and not the password
    with pytest.raises(DatabaseError, match=r"'down\.t'.*transaction of its own failed") as raised:
        t.delay()
    assert "s3cret" not in str(raised.value) and "\n" not in str(raised.value)
    outbox.sessions().kw["bind"].dispose()


def test_a_dedup_key_holds_with_no_transaction_open(tasks: TaskApp) -> None:
    # Given a script that sends "recompute cart 7" three times with one dedup key, keep-first then replace
    key = {"outbox_dedup_key": "cart:7"}
    first = tasks.step.apply_async((1,), headers=key)
    tasks.step.apply_async((2,), headers=key)
    last = tasks.step.apply_async((3,), headers={**key, "outbox_dedup_on_conflict": "replace"})
    # Then one pending row holds the key, the replacing one, and the relay publishes it once
    [row] = tasks.rows()
    assert str(row.message_id) == last.id != first.id
    assert [m.message_id for m in drain(tasks.outbox).published] == [last.id]
