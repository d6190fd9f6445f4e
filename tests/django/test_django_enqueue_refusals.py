"""On Django, ``.delay()`` inside ``atomic()`` refuses what the enqueue rule table refuses, before the ORM writes.

The capture is shared with the SQLAlchemy path (celery_outbox/celery/enqueue.py); these are the
cases that reached Postgres before: NUL and lone surrogates (a raw driver error at the insert),
arguments 999 deep (a ``RecursionError``), and a reused task id (a unique violation).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import transaction
from shop.models import Order

from celery_outbox.contrib.django.models import OutboxMessage
from celery_outbox.errors import ValidationError
from tests.django.test_django_enqueue import confirm, make_order

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
__all__ = ["confirm"]  # the fixture, shared with test_django_enqueue


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(("args", "match"), [
    (("a\x00",), "NUL character or a lone surrogate"),
    (("\ud800",), "NUL character or a lone surrogate"),
    ((nested(999),), "nested deeper than"),
])
def test_hostile_arguments_are_refused_inside_atomic(shop_outbox: Any, confirm: Any, args: Any, match: str) -> None:
    # Given a view inside atomic() that creates an order, When the task's arguments are hostile
    with transaction.atomic():
        make_order("o-r1")
        with pytest.raises(ValidationError, match=match):
            confirm.delay(*args)
    # Then the order committed and no outbox row was written
    assert Order.objects.filter(id="o-r1").exists()
    assert OutboxMessage.objects.count() == 0


def test_a_reused_task_id_is_refused_and_a_uuid_spelling_is_normalised(shop_outbox: Any, confirm: Any) -> None:
    tid = uuid.uuid4()
    with transaction.atomic():
        confirm.apply_async(("o-r2",), task_id=str(tid).upper())
    assert [str(m.message_id) for m in OutboxMessage.objects.all()] == [str(tid)]
    with transaction.atomic(), pytest.raises(ValidationError, match="already holds"):
        confirm.apply_async(("o-r2",), task_id=tid.hex)
    assert OutboxMessage.objects.count() == 1
