"""Django's Tasks framework (``django.tasks``, Django 6) on ``OutboxTaskBackend``: ``@task`` + ``.enqueue()`` is an
outbox row of the open ``atomic()``, run by the outbox's Celery task with the inbox, retries and dead letters.

Skipped on Django 5.2 (no ``django.tasks``); ``make test`` runs it in the Django 6 virtualenv. Real Postgres;
the runner's deliveries are Celery's ``apply`` (eager, with the task id the enqueue chose), so every run goes
through the same delivery core a worker's would.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("django.tasks", reason="django.tasks needs Django 6 (make test runs it in .venv-django6)")

from celery import Celery
from celery import _state as celery_state
from django.db import transaction
from django.tasks import TaskResultStatus
from django.tasks.exceptions import InvalidTask
from django.tasks.signals import task_enqueued
from shop.models import Order

from celery_outbox.contrib.django import DjangoOutbox, use
from celery_outbox.contrib.django.models import ConsumerDeadLetter, InboxEntry, OutboxMessage
from celery_outbox.contrib.django.task_runner import RUNNER
from celery_outbox.errors import TransactionRequiredError
from celery_outbox.settings import Settings
from tests.django import django_tasks_app as tasks

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def outbox() -> Iterator[DjangoOutbox]:
    """The project's DjangoOutbox (registered, as proj/celery.py's is); ``.delay()`` outside atomic() commits."""
    saved = celery_state.default_app
    app = Celery(f"t{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    built = DjangoOutbox(app, settings=Settings(namespace=f"dj{uuid.uuid4().hex[:8]}", consumer_max_deliveries=3,
                                                enqueue_outside_transaction="own_transaction"))
    yield built
    celery_state.set_default_app(saved)
    use(None)


def task_rows() -> list[OutboxMessage]:
    return list(OutboxMessage.objects.filter(type=RUNNER).order_by("seq"))


def run_row(outbox: DjangoOutbox, row: OutboxMessage, *, retries: int = 0) -> Any:
    """One delivery of the enqueued row, as a worker would take it (its task id, its arguments)."""
    runner = outbox.app.tasks[RUNNER]
    args, kwargs, _embed = row.payload["body"]  # the Celery message body the relay will publish
    return runner.apply(args=args, kwargs=kwargs, task_id=str(row.message_id), retries=retries)


def call_args(row: OutboxMessage) -> list[Any]:
    args: list[Any] = row.payload["body"][0]
    return args


def test_enqueue_in_atomic_is_a_row_of_that_transaction(outbox: DjangoOutbox) -> None:
    seen: list[Any] = []
    task_enqueued.connect(lambda sender, task_result, **_: seen.append(task_result), weak=False, dispatch_uid="t1")
    try:
        # When a view enqueues a Django Task inside atomic(), then rolls back
        with pytest.raises(RuntimeError), transaction.atomic():
            tasks.record_order.enqueue("o-rolled-back")
            assert len(task_rows()) == 1  # the row is there, uncommitted
            raise RuntimeError("the view fails")
        # Then nothing is left to send
        assert task_rows() == []
        # When another commits
        with transaction.atomic():
            result = tasks.record_order.enqueue("o-1", total_cents=250)
    finally:
        task_enqueued.disconnect(dispatch_uid="t1")
    # Then one pending row carries the Task's path and arguments, its message id the TaskResult's id
    [row] = task_rows()
    assert row.published_at_ms is None
    assert call_args(row) == ["tests.django.django_tasks_app.record_order", ["o-1"], {"total_cents": 250}, "outbox"]
    assert str(row.message_id) == result.id
    assert (result.status, result.backend, result.args, result.kwargs) == (
        TaskResultStatus.READY, "outbox", ["o-1"], {"total_cents": 250})
    # and task_enqueued fired for each enqueue (the rolled-back one included: it was enqueued, in its transaction)
    assert [r.args for r in seen] == [["o-rolled-back"], ["o-1"]] and seen[1].id == result.id


def test_enqueue_outside_atomic_follows_the_outside_transaction_mode(outbox: DjangoOutbox) -> None:
    # own_transaction: a row committed at once
    tasks.record_order.enqueue("o-script")
    assert [call_args(r)[1] for r in task_rows()] == [["o-script"]]
    # raise (the strict mode): refused, nothing written
    outbox.settings = Settings(namespace=outbox.settings.namespace, enqueue_outside_transaction="raise")
    with pytest.raises(TransactionRequiredError):
        tasks.record_order.enqueue("o-refused")
    assert len(task_rows()) == 1


def test_a_worker_runs_the_task_once_with_the_inbox(outbox: DjangoOutbox) -> None:
    with transaction.atomic():
        tasks.record_order.enqueue("o-1", total_cents=250)
    [row] = task_rows()
    # When the worker runs it
    first = run_row(outbox, row)
    # Then the effect (an ORM write) and the inbox row committed together; the return value is the Task's
    assert first.get() == {"order_id": "o-1"}
    assert Order.objects.filter(id="o-1").count() == 1
    assert list(InboxEntry.objects.values_list("message_id", "consumer")) == [(row.message_id, f"task:{RUNNER}")]
    # When the same message is delivered again (a relay duplicate, a redelivery after a killed worker)
    second = run_row(outbox, row)
    # Then the inbox absorbs it: still one effect
    assert second.get() == f"duplicate of {row.message_id}"
    assert Order.objects.filter(id="o-1").count() == 1


def test_a_failing_task_is_retried_then_succeeds_and_its_failed_writes_roll_back(outbox: DjangoOutbox) -> None:
    tasks.FAILURES["o-2"] = 1
    with transaction.atomic():
        tasks.flaky_order.enqueue("o-2")
    [row] = task_rows()
    # When the first delivery raises (Celery's eager apply runs the retry the task asks for at once)
    result = run_row(outbox, row)
    # Then the retry succeeded, saw its attempt number, and the first attempt's ORM write rolled back
    assert (result.state, result.get()) == ("SUCCESS", 2)
    assert list(Order.objects.filter(id__startswith="o-2").values_list("id", flat=True)) == ["o-2-attempt-2"]
    assert InboxEntry.objects.count() == 1


def test_a_task_that_keeps_failing_is_a_dead_letter_and_replay_resends_it(outbox: DjangoOutbox) -> None:
    tasks.FAILURES["o-3"] = 3  # as many as the deliveries allowed (consumer_max_deliveries=3)
    with transaction.atomic():
        tasks.flaky_order.enqueue("o-3")
    [row] = task_rows()
    result = run_row(outbox, row)
    # Then after the third delivery it is a consumer dead letter, its arguments kept, nothing written
    assert result.state == "REJECTED" and "after 3 deliveries" in str(result.result)  # DeadLettered: a Reject
    [dead] = ConsumerDeadLetter.objects.all()
    assert dead.consumer == f"task:{RUNNER}" and "transient failure of o-3" in dead.last_error
    assert not Order.objects.filter(id__startswith="o-3").exists() and not InboxEntry.objects.exists()
    # When a person replays it (the admin, `manage.py outbox dead-letters replay`): the same task, same arguments
    sent: list[tuple[str, Any]] = []
    use(outbox, send=lambda consumer, envelope: sent.append((consumer, envelope)))
    from celery_outbox.contrib.django import dead_letters
    from celery_outbox.ops.dead_letters import parse_ids

    dead_letters.replay(parse_ids([f"consumer:{dead.pk}"]))
    [(consumer, envelope)] = sent
    assert consumer == f"task:{RUNNER}" and envelope["payload"]["args"] == call_args(row)


def test_what_the_backend_refuses(outbox: DjangoOutbox) -> None:
    with pytest.raises(InvalidTask, match="priority"):
        tasks.record_order.using(priority=10)
    with pytest.raises(InvalidTask, match="not valid for backend"):
        tasks.record_order.using(queue_name="nowhere")
    # a queue_name the backend lists becomes the Celery queue of that name
    with transaction.atomic():
        tasks.mail_order.enqueue("o-4")
    [row] = task_rows()
    assert row.headers["queue"]["name"] == "mail"
