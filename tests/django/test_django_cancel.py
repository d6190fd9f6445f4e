"""The Django twin of ``outbox.cancel``: ``celery_outbox.contrib.django.cancel(task_id)`` inside ``atomic()``
deletes the pending task row with the view's transaction; after publish it raises (docs/scheduled.md).

Real Postgres, real commits (``django_db(transaction=True)``), the example shop's ``Outbox``.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import transaction

from celery_outbox import AlreadyPublishedError, ManualClock, NotFoundError
from celery_outbox.contrib.django import cancel
from celery_outbox.contrib.django.models import ConsumerCounter, OutboxMessage
from celery_outbox.errors import TransactionRequiredError
from celery_outbox.testing import drain
from tests.django.test_django_enqueue import confirm, make_order

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
_ = confirm  # the fixture


def test_a_cancelled_task_is_never_published(shop_outbox: Any, confirm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a reminder sent with a countdown in one view, committed
    with transaction.atomic():
        make_order("o-1")
        reminder = confirm.apply_async(("o-1",), countdown=3600)
    # When another view cancels it
    with transaction.atomic():
        cancelled = cancel(reminder.id)
    # Then the row is gone, counted, and the relay never publishes it, even after its due time
    assert str(cancelled.message_id) == reminder.id and cancelled.type == confirm.name
    assert not OutboxMessage.objects.exists()
    assert ConsumerCounter.total("_relay", "cancelled") == 1
    monkeypatch.setattr(shop_outbox, "clock", ManualClock(start_ms=cancelled.due_at_ms + 1))
    assert drain(shop_outbox).published == []


def test_after_publish_outside_atomic_and_unknown_ids_are_reported(shop_outbox: Any, confirm: Any) -> None:
    with transaction.atomic():
        make_order("o-2")
        sent = confirm.delay("o-2")
    assert drain(shop_outbox).message_ids() == [sent.id]
    # A cancel after publish raises, and the view's transaction still commits its own work
    with transaction.atomic():
        with pytest.raises(AlreadyPublishedError, match="already published"):
            cancel(sent.id)
        make_order("o-3")
    with pytest.raises(TransactionRequiredError, match=r"inside transaction\.atomic\(\)"):
        cancel(sent.id)
    with transaction.atomic(), pytest.raises(NotFoundError):
        cancel(uuid.uuid4())
