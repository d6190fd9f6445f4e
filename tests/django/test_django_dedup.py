"""Deduplicate by key on Django: ``apply_async(headers={"outbox_dedup_key": K, ...})`` inside ``atomic()``
keeps at most one pending task with K, keep-first or replace (docs/scheduled.md "Deduplicate by key").

Real Postgres, real commits (``django_db(transaction=True)``), the example shop's ``Outbox``; one case with
two views racing on one key in separate transactions.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connections, transaction

from celery_outbox import ValidationError
from celery_outbox.contrib.django.models import OutboxMessage
from celery_outbox.testing import drain
from tests.django.test_django_enqueue import confirm

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
_ = confirm  # the fixture
KEY = "recompute-order:o-1"


def keyed(on_conflict: str = "keep") -> dict[str, Any]:
    return {"headers": {"outbox_dedup_key": KEY, "outbox_dedup_on_conflict": on_conflict}}


def test_keep_first_and_replace_inside_atomic(shop_outbox: Any, confirm: Any) -> None:
    # Given a task with K in one view
    with transaction.atomic():
        first = confirm.apply_async(("o-1",), **keyed())
    # When a second view sends K keep-first, Then nothing is written
    with transaction.atomic():
        confirm.apply_async(("o-2",), **keyed())
    assert [str(m) for m in OutboxMessage.objects.values_list("message_id", flat=True)] == [first.id]
    # When a third view sends K replace, Then its task is the one pending row, and the relay sends only it
    with transaction.atomic():
        third = confirm.apply_async(("o-3",), **keyed("replace"))
    [row] = OutboxMessage.objects.all()
    assert (str(row.message_id), row.dedup_key) == (third.id, KEY)
    assert drain(shop_outbox).message_ids() == [third.id]


def test_a_rolled_back_view_keeps_nothing_and_a_bad_key_writes_nothing(shop_outbox: Any, confirm: Any) -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        confirm.apply_async(("o-1",), **keyed())
        raise RuntimeError("the view failed")
    with transaction.atomic():
        second = confirm.apply_async(("o-2",), **keyed())
        with pytest.raises(ValidationError, match="dedup key"):
            confirm.apply_async(("o-3",), headers={"outbox_dedup_key": ""})
    assert [str(m) for m in OutboxMessage.objects.values_list("message_id", flat=True)] == [second.id]


def test_two_views_racing_on_one_key_leave_one_pending_task(shop_outbox: Any, confirm: Any) -> None:
    # Given view 1 has written K and not committed
    done: dict[str, Any] = {}
    started = threading.Event()

    def view_2() -> None:
        try:
            with transaction.atomic():
                started.set()
                done["second"] = confirm.apply_async(("o-2",), **keyed("replace"))
        except BaseException as e:
            done["error"] = e
        finally:
            connections.close_all()

    with transaction.atomic():
        first = confirm.apply_async(("o-1",), **keyed())
        # When view 2 replaces K meanwhile (it waits on the unique index until view 1 commits)
        t = threading.Thread(target=view_2)
        t.start()
        started.wait(10)
        t.join(0.5)
        assert t.is_alive(), f"view 2 did not wait for view 1: {done}"
    t.join(10)
    # Then view 2 replaced view 1's task: one pending row, view 2's
    assert "error" not in done, done.get("error")
    assert [str(m) for m in OutboxMessage.objects.values_list("message_id", flat=True)] == [done["second"].id]
    assert done["second"].id != first.id
