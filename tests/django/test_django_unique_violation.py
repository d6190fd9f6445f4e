"""``celery_outbox.is_unique_violation`` on Django's own ``IntegrityError`` (the driver's error is its cause)."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction
from shop.models import Order

from celery_outbox import is_unique_violation

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def order(order_id: str, email: str | None = "a@example.com") -> Order:
    return Order(id=order_id, customer_id="c-1", email=email, currency="EUR", total_cents=100, created_at_ms=1)


def test_a_duplicate_primary_key_through_the_orm_is_a_unique_violation() -> None:
    # Given an order, When the ORM inserts another with its id
    order("o-1").save(force_insert=True)
    with pytest.raises(IntegrityError) as caught, transaction.atomic():
        order("o-1").save(force_insert=True)
    # Then Django's error (psycopg 3's or psycopg2's as its cause) is a unique violation
    assert connection.vendor == "postgresql"
    assert is_unique_violation(caught.value)


def test_a_null_in_a_not_null_column_through_the_orm_is_not_one() -> None:
    with pytest.raises(IntegrityError) as caught, transaction.atomic():
        order("o-2", email=None).save(force_insert=True)
    assert not is_unique_violation(caught.value)
