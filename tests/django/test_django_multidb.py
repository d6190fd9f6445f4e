"""``using=`` in a multi-database project: a ``DjangoOutbox(app, using="other")`` is the database every call
that names none follows (``publish``, ``cancel``, the testing helpers, the consumers it includes), so no row
or inbox entry lands on "default" by omission. "other" is a second Django alias of the session's database,
added for these tests: each alias is its own connection, so a write in ``atomic(using="other")`` is invisible
to "default" until it commits, which is what tells the two apart here."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery import _state as celery_state
from django.db import connections, transaction
from shop.models import Shipment
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Event
from celery_outbox.clock import ManualClock
from celery_outbox.contrib.django import DjangoConsumerSpec, DjangoOutbox, cancel, idempotent_consumer, publish, use
from celery_outbox.contrib.django.dead_letters import registered
from celery_outbox.contrib.django.models import InboxEntry, OutboxMessage
from celery_outbox.contrib.django.testing import enqueued_tasks
from celery_outbox.delivery import deliver
from celery_outbox.errors import ConfigError
from celery_outbox.inbox.outcome import Outcome
from celery_outbox.messages import Envelope
from celery_outbox.schema import Tables
from celery_outbox.settings import Settings

OTHER = "other"

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True, databases=["default", OTHER])]


@pytest.fixture(scope="module", autouse=True)
def other_alias() -> Iterator[None]:
    """The alias "other" for this module's tests (module scope: it exists before the test case is set up)."""
    connections.settings[OTHER] = dict(connections.settings["default"])
    try:
        yield
    finally:
        connections[OTHER].close()
        del connections[OTHER]
        del connections.settings[OTHER]


@pytest.fixture
def other_outbox() -> Iterator[tuple[DjangoOutbox, Any]]:
    """A DjangoOutbox on the alias "other" (registered, as a project's is), with one task; Celery's default
    app and the registered Outbox restored afterwards."""
    saved_app, saved_outbox = celery_state.default_app, registered()
    app = Celery(f"multidb{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    outbox = DjangoOutbox(app, using=OTHER, settings=Settings(namespace=f"dj{uuid.uuid4().hex[:8]}"))

    @app.task(name=f"multidb.confirm_{uuid.uuid4().hex[:6]}", shared=False)  # type: ignore[untyped-decorator]
    def confirm(order_id: str) -> str:
        return order_id

    try:
        yield outbox, confirm
    finally:
        celery_state.set_default_app(saved_app)
        use(saved_outbox)


def ship(env: Envelope) -> None:
    Shipment.objects.using(OTHER).create(order_id=env.payload["order_id"], items=1, created_at_ms=1)


def test_publish_and_cancel_without_using_write_on_the_outboxs_database(other_outbox: tuple[DjangoOutbox, Any]) -> None:
    _outbox, confirm = other_outbox
    # Given a transaction open on the outbox's database only ("default" stays in autocommit)
    with transaction.atomic(using=OTHER):
        # When an event is published and a task sent and cancelled, none of them naming a database
        row = publish(Event("OrderPlaced", {"order_id": "o-1"}))
        task_id = confirm.delay("o-1").id
        assert cancel(task_id).message_id == uuid.UUID(task_id)
        # Then they went through "other", in its transaction, where "default" cannot see them yet
        assert row._state.db == OTHER
        assert not OutboxMessage.objects.using("default").exists()
    assert list(OutboxMessage.objects.using("default").values_list("type", flat=True)) == ["OrderPlaced"]


def test_the_testing_helpers_read_the_outboxs_database(other_outbox: tuple[DjangoOutbox, Any]) -> None:
    outbox, confirm = other_outbox
    with transaction.atomic(using=OTHER):
        confirm.delay("o-2")
        [message] = enqueued_tasks(outbox)  # the uncommitted row of "other"'s transaction
        assert message.headers["task"] == confirm.name
        transaction.set_rollback(True, using=OTHER)


def test_an_included_consumer_runs_on_the_outboxs_database(other_outbox: tuple[DjangoOutbox, Any],
                                                           tables: Tables) -> None:
    outbox, _ = other_outbox
    # Given a consumer declared without using=, included by the outbox of "other"
    spec = outbox.include(idempotent_consumer("OrderPlaced", name="ship_other")(ship))
    # Then it runs on "other": its inbox row and effect commit in one atomic() there
    assert isinstance(spec, DjangoConsumerSpec) and spec.using == OTHER and outbox.registry["ship_other"] is spec
    sessions: sessionmaker[Session] = outbox.sessions()
    body = Envelope(message_id=uuid.uuid4(), type="OrderPlaced", payload={"order_id": "o-3"}, headers={},
                    created_at_ms=1).to_dict()
    result = deliver(sessions, spec, body, tables=tables, request_id=None, settings=outbox.settings,
                     clock=ManualClock(), first_delivery=True)
    assert result.outcome is Outcome.PROCESSED
    assert InboxEntry.objects.using(OTHER).filter(consumer="ship_other").count() == 1
    assert Shipment.objects.count() == 1


def test_a_consumer_naming_another_database_than_its_outbox_is_refused(other_outbox: tuple[DjangoOutbox, Any]) -> None:
    outbox, _ = other_outbox
    spec = idempotent_consumer("OrderPlaced", name="split", using="default")(ship)
    with pytest.raises(ConfigError, match="uses Django database 'default', this outbox 'other'"):
        outbox.include(spec)
    assert "split" not in outbox.registry
