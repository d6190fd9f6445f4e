"""The Django admin shows what ``outbox dead-letters groups`` and ``outbox trace`` show (real Postgres, Django's
test Client): linked from the consumer dead letters' list, behind the model's view permission, escaped."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from html import escape
from typing import Any

import pytest
from django.apps import apps
from django.contrib.auth.management import create_permissions
from django.contrib.contenttypes.models import ContentType
from django.test import Client
from django.urls import reverse
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Outbox
from celery_outbox.contrib.django import use
from celery_outbox.ops import dead_letter_groups as groups
from celery_outbox.schema import Tables
from tests.django.test_django_admin import CONSUMER_LIST, consumer_dead_letter, envelope, html, login

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

GROUPS = reverse("admin:celery_outbox_consumerdeadletter_groups")
TRACE = reverse("admin:celery_outbox_consumerdeadletter_trace")


@pytest.fixture(autouse=True)
def _auth_rows(_empty_tables: None) -> None:
    """The conftest empties every table, content types and permissions included: put them back."""
    ContentType.objects.clear_cache()
    for config in apps.get_app_configs():
        create_permissions(config, verbosity=0)


@pytest.fixture
def configured(shop_outbox: Outbox) -> Iterator[Outbox]:
    use(shop_outbox, send=lambda consumer, env: None)
    yield shop_outbox
    use(None)


def test_the_groups_page_lists_both_failures_with_counts(configured: Outbox, sa_sessions: sessionmaker[Session],
                                                         tables: Tables) -> None:
    # Given two dead letters for missing orders and one whose error holds markup
    for order in ("1", "22"):
        consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope({"order_id": order})),
                             error=f"LookupError: order {order} not found")
    consumer_dead_letter(sa_sessions, tables, body=json.dumps(envelope()), error="RuntimeError: <b>carrier</b> down")
    with sa_sessions() as s:
        listed = groups.list_groups(s, tables=tables)
    # When a user with the view permission opens the list, then its Groups link
    viewer = login("viewer", perms=("view_consumerdeadletter",))
    assert f'href="{GROUPS}"' in html(viewer.get(CONSUMER_LIST))
    r = viewer.get(GROUPS)
    page = html(r)
    # Then both groups are there with their counts and samples, the error escaped
    assert r.status_code == 200, page
    assert "2 group(s), 3 dead letter(s)" in page
    for g in listed:
        row = re.search(rf'<tr data-group="{g.id}">(.*?)</tr>', page, flags=re.S)
        assert row and f"<td>{g.count}</td>" in row.group(1) and g.sample_id in row.group(1), g.id
    assert "<b>carrier</b>" not in page and escape("<b>carrier</b>") in page


def test_the_trace_page_tells_one_messages_story(configured: Outbox, sa_sessions: sessionmaker[Session],
                                                 tables: Tables) -> None:
    # Given a published message that one consumer dead-lettered
    mid = uuid.uuid4()
    with sa_sessions() as s:
        s.add(tables.outbox(message_id=mid, type="OrderPlaced", payload={"order_id": "42"},
                            headers={"correlation_id": "req-42", "entity_key": "order:42"},
                            created_at_ms=1_700_000_000_000, published_at_ms=1_700_000_000_040, attempts=0,
                            next_attempt_at_ms=1_700_000_000_000))
        s.commit()
    dl_id = consumer_dead_letter(sa_sessions, tables, body=json.dumps({**envelope(), "message_id": str(mid)}),
                                 message_id=str(mid), error="LookupError: order 42 not found")
    viewer = login("viewer", perms=("view_consumerdeadletter",))
    # When it is traced by its entity key
    r = viewer.get(TRACE, {"key": "order:42"})
    page = html(r)
    # Then the page shows its publish and the consumer's dead letter
    assert r.status_code == 200, page
    assert f"{mid} (event, OrderPlaced): published" in page and "(+40 ms)" in page
    assert f"consumer:{dl_id}" in page and "order 42 not found" in page
    assert "Not recorded, so not shown" in page


@pytest.mark.parametrize(("key", "status", "said"), [
    ("order:404", 404, "no outbox message has id, entity_key or correlation_id"),
    ("x" * 5000, 400, "is not a message id or key"),
])
def test_the_trace_page_refuses_what_the_cli_refuses(configured: Outbox, key: str, status: int, said: str) -> None:
    r = login("viewer", perms=("view_consumerdeadletter",)).get(TRACE, {"key": key})
    assert r.status_code == status and said in html(r)


def test_no_view_permission_no_page(configured: Outbox) -> None:
    # Given staff without any permission on the dead letters
    nobody: Client = login("nobody")
    # Then both pages are refused
    for url in (GROUPS, TRACE + "?key=order:42"):
        assert nobody.get(url).status_code == 403
    # And anonymous users are sent to the login page
    anonymous: Any = Client().get(GROUPS)
    assert anonymous.status_code == 302 and "login" in anonymous["Location"]
