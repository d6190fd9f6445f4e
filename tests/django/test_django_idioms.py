"""The Django idioms for sending a task, each with the guarantee docs/django.md states ("idiom -> guarantee"):

* ``.delay()`` inside ``atomic()``: a row of that transaction (tests/django/test_django_enqueue.py);
* ``task.delay_on_commit()`` inside ``atomic()``: a row of that transaction too, written at once;
* ``transaction.on_commit(lambda: task.delay())`` and ``.delay()`` in a script, a command or a shell (no
  ``atomic()``): a row committed in an ``atomic()`` of its own (``enqueue_outside_transaction =
  "own_transaction"``), or ``TransactionRequiredError`` in the strict mode (``"raise"``);
* a process that never built the project's Outbox: ``.delay()`` of a ``@shared_task`` is refused, never sent
  to Celery's default broker.

Real Postgres and real commits; the relay is the library's, with the in-memory publisher. The SIGKILL
between commit and publish of each idiom is in tests/adoption/test_django_adoption.py.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery, shared_task
from celery import _state as celery_state
from django.db import transaction

from celery_outbox.contrib.django import DjangoOutbox, use
from celery_outbox.contrib.django.models import OutboxMessage
from celery_outbox.errors import ConfigError, TransactionRequiredError
from celery_outbox.settings import Settings
from celery_outbox.testing import drain

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def make(sa_engine: Any) -> Iterator[Callable[..., tuple[DjangoOutbox, Any]]]:
    """A DjangoOutbox on a memory-broker app with one task; Celery's default app and the admin's Outbox restored."""
    saved = celery_state.default_app

    def build(mode: str = "own_transaction", name: str | None = None, **overrides: Any) -> tuple[DjangoOutbox, Any]:
        app = Celery(f"idioms{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
        outbox = DjangoOutbox(app, settings=Settings(namespace=f"dj{uuid.uuid4().hex[:8]}",
                                                     enqueue_outside_transaction=mode, **overrides))

        @app.task(name=name or f"idioms.confirm_{uuid.uuid4().hex[:6]}", shared=False)  # type: ignore[untyped-decorator]
        def confirm(order_id: str) -> str:
            return order_id

        return outbox, confirm

    yield build
    celery_state.set_default_app(saved)
    use(None)


def committed_task_rows(sa_engine: Any) -> list[tuple[str, str]]:
    """(type, message id) of the task rows another connection sees: what is committed, what the relay reads."""
    with sa_engine.connect() as c:
        rows = c.exec_driver_sql("SELECT type, message_id FROM outbox_messages ORDER BY seq").all()
    return [(str(t), str(m)) for t, m in rows]


def test_on_commit_delay_after_the_commit_writes_a_row_of_its_own(make: Any, sa_engine: Any) -> None:
    outbox, confirm = make()
    # Given the idiom Django's docs teach: send the task once the order has committed
    ids: list[str] = []
    with transaction.atomic():
        transaction.on_commit(lambda: ids.append(confirm.delay("o-1").id))
        assert committed_task_rows(sa_engine) == []
    # Then it does not raise after the commit: its row committed in a transaction of its own
    assert committed_task_rows(sa_engine) == [(confirm.name, ids[0])]
    # and the relay publishes it as the task's own message
    [message] = drain(outbox).published
    assert message.headers["task"] == confirm.name and message.headers["id"] == ids[0]


def test_the_strict_mode_refuses_on_commit_delay_and_writes_nothing(make: Any, sa_engine: Any) -> None:
    _outbox, confirm = make(mode="raise")
    # Given the strict mode, when a task is sent after the commit
    with pytest.raises(TransactionRequiredError, match="outside a transaction"), transaction.atomic():
        transaction.on_commit(lambda: confirm.delay("o-1"))
    # Then nothing is written (and nothing was sent: the app's broker is never asked)
    assert committed_task_rows(sa_engine) == []


def test_delay_on_commit_inside_atomic_is_a_row_of_that_transaction(make: Any, sa_engine: Any) -> None:
    _outbox, confirm = make()
    # Given delay_on_commit inside atomic(): the row is written now, in the view's transaction
    with transaction.atomic():
        result = confirm.delay_on_commit("o-1")
        assert OutboxMessage.objects.filter(message_id=uuid.UUID(result.id)).exists()
        assert committed_task_rows(sa_engine) == []  # not committed yet: no window after the commit
    assert committed_task_rows(sa_engine) == [(confirm.name, result.id)]
    # and when the view's transaction rolls back, the task goes with it
    with pytest.raises(RuntimeError), transaction.atomic():
        confirm.apply_async_on_commit(("o-2",))
        raise RuntimeError("payment declined")
    assert len(committed_task_rows(sa_engine)) == 1


def test_delay_on_commit_of_a_task_the_outbox_does_not_carry_keeps_djangos_on_commit(make: Any,
                                                                                    sa_engine: Any) -> None:
    name = f"idioms.excluded_{uuid.uuid4().hex[:6]}"
    _outbox, confirm = make(name=name, enqueue_exclude=(name,))
    sent: list[str] = []
    # Given a task the outbox never carries (OUTBOX_ENQUEUE_EXCLUDE), sent with delay_on_commit in atomic()
    with transaction.atomic():
        transaction.on_commit(lambda: sent.append("committed"))
        assert confirm.delay_on_commit("o-1") is None  # deferred to Django's on_commit, as Celery does
        assert sent == []
    # Then it went after the commit (to the app's memory broker), never as a row
    assert sent == ["committed"]
    assert committed_task_rows(sa_engine) == []  # sent to the broker after the commit, never a row


def test_delay_in_a_script_writes_a_committed_row_on_its_own(make: Any, sa_engine: Any) -> None:
    _outbox, confirm = make()
    # Given no atomic() at all (a script, a management command, a shell)
    result = confirm.delay("o-1")
    # Then the row is committed already: durable, the relay will send it
    assert committed_task_rows(sa_engine) == [(confirm.name, result.id)]


def test_a_process_that_never_built_the_outbox_refuses_shared_task_delay(make: Any) -> None:
    name = f"idioms.shared_{uuid.uuid4().hex[:6]}"

    @shared_task(name=name)  # type: ignore[untyped-decorator]
    def notify(order_id: str) -> str:
        return order_id

    def in_a_fresh_thread(fn: Callable[[], Any]) -> Any:
        """A thread of this process with no current Celery app (a web server's request thread)."""
        out: dict[str, Any] = {}

        def run() -> None:
            from django.db import connections

            try:
                out["value"] = fn()
            except Exception as e:
                out["error"] = e
            finally:
                connections.close_all()  # this thread's own Django connection

        t = threading.Thread(target=run)
        t.start()
        t.join(30)
        return out

    # Given Django loaded the app (ready() ran) and no DjangoOutbox was built in this process
    assert celery_state.default_app is not None and celery_state.default_app.main == "celery_outbox.unbound"
    # When a @shared_task is sent
    out = in_a_fresh_thread(lambda: notify.delay("o-1"))
    # Then it fails loudly, saying how to bind the process, and nothing was sent anywhere
    assert isinstance(out.get("error"), ConfigError), out
    assert "never built the project's Outbox" in str(out["error"]) and "nothing was sent" in str(out["error"])
    # And once the project's outbox is built, the same task in any thread is an outbox row
    _outbox, _confirm = make()
    result = in_a_fresh_thread(lambda: notify.delay("o-1"))["value"]
    assert OutboxMessage.objects.filter(message_id=uuid.UUID(result.id), type=name).exists()
