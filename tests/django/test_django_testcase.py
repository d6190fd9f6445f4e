"""Tasks enqueued inside a real Django ``TestCase`` (each test wrapped in ``atomic()``, rolled back after).

``on_commit`` never fires there and the relay cannot see the test's uncommitted rows, so a task sent
with ``.delay()`` stays a pending outbox row. ``celery_outbox.contrib.django.testing`` shows these rows
as the messages the relay would publish and runs them in the test's own transaction (docs/django.md,
"Tests"). Real Postgres, the example shop's ``Outbox``; the tasks write through the Django ORM.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import chain
from django.db import transaction
from django.test import TestCase
from shop.models import Order, Shipment

from celery_outbox.contrib.django.models import OutboxMessage
from celery_outbox.contrib.django.testing import enqueued_tasks, run_enqueued_tasks
from celery_outbox.errors import ConfigError

pytestmark = [pytest.mark.postgres]

SUFFIX = uuid.uuid4().hex[:8]
CONFIRM, SHIP, FAIL, ELSEWHERE, WHOAMI = (f"testcase.{n}_{SUFFIX}"
                                          for n in ("confirm", "ship", "fail", "elsewhere", "whoami"))
MAIL_QUEUE = f"mail-{SUFFIX}"


def set_routes(app: Any, routes: Any) -> None:
    """Change ``task_routes`` on an app that may have routed already (Celery caches its router)."""
    app.conf.task_routes = routes
    app.amqp.flush_routes()
    app.amqp.__dict__.pop("router", None)


def make_order(order_id: str) -> None:
    Order.objects.create(id=order_id, customer_id="c-1", email="a@example.com", currency="EUR",
                                total_cents=100, created_at_ms=0)


class EnqueueInTestCase(TestCase):  # type: ignore[misc]
    outbox: Any
    confirm: Any
    ship: Any
    whoami: Any

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        from shop_project.celery import outbox

        cls.outbox = outbox
        app = outbox.app
        cls._routes = app.conf.task_routes
        set_routes(app, {**(cls._routes or {}), ELSEWHERE: {"queue": "another-service"}, WHOAMI: {"queue": MAIL_QUEUE}})

        @app.task(name=SHIP, shared=False)  # type: ignore[untyped-decorator]
        def ship(order_id: str) -> int:
            return int(Shipment.objects.create(order_id=order_id, items=1, created_at_ms=0).id)

        @app.task(name=CONFIRM, shared=False)  # type: ignore[untyped-decorator]
        def confirm(order_id: str, *, then_ship: bool = False) -> str:
            Order.objects.filter(id=order_id).update(status="confirmed")  # sees the test's uncommitted order
            if then_ship:
                ship.delay(order_id)  # inside the test's atomic(): one more row, run in the next round
            return order_id

        @app.task(name=FAIL, shared=False)  # type: ignore[untyped-decorator]
        def fail(order_id: str) -> None:
            raise ValueError(f"cannot confirm {order_id}")

        @app.task(name=WHOAMI, bind=True, shared=False)  # type: ignore[untyped-decorator]
        def whoami(self: Any) -> dict[str, Any]:
            """What a worker hands the task from the message: its headers and the queue it came from."""
            return {"tenant": (self.request.headers or {}).get("tenant"),
                    "queue": self.request.delivery_info.get("routing_key")}

        cls.confirm, cls.ship, cls.fail, cls.whoami = confirm, ship, fail, whoami

    @classmethod
    def tearDownClass(cls) -> None:
        app = cls.outbox.app
        for name in (CONFIRM, SHIP, FAIL, WHOAMI):
            app.tasks.unregister(name)
        set_routes(app, cls._routes)
        super().tearDownClass()

    def test_delay_stays_a_pending_row_until_the_helper_runs_it(self) -> None:
        # Given a view body run in the TestCase's transaction: an order, and its task sent with .delay()
        make_order("o-1")
        result = self.confirm.delay("o-1", then_ship=True)
        # Then nothing ran: the task is a pending row, which the helper shows as the relay would publish it
        [message] = enqueued_tasks(self.outbox)
        assert (message.headers["task"], message.headers["id"]) == (CONFIRM, result.id)
        assert message.headers["argsrepr"] == "('o-1',)" and message.headers["kwargsrepr"] == "{'then_ship': True}"
        assert Order.objects.get(id="o-1").status == "placed"
        # When the helper runs the enqueued tasks
        ran = run_enqueued_tasks(self.outbox)
        # Then the task ran with its id and arguments on the test's data, then the task it enqueued
        assert [(r.name, r.state) for r in ran] == [(CONFIRM, "SUCCESS"), (SHIP, "SUCCESS")]
        assert ran[0].id == result.id
        assert Order.objects.get(id="o-1").status == "confirmed"
        assert list(Shipment.objects.values_list("order_id", flat=True)) == ["o-1"]
        # And every row is marked: running again runs nothing twice
        assert enqueued_tasks(self.outbox) == []
        assert run_enqueued_tasks(self.outbox) == []
        assert OutboxMessage.objects.filter(published_at_ms__isnull=True).count() == 0

    def test_a_chain_runs_step_by_step_with_the_previous_result(self) -> None:
        make_order("o-2")
        # Given a chain sent in the test: confirm, then ship with confirm's result
        chain(self.confirm.s("o-2"), self.ship.s()).delay()
        assert [m.headers["task"] for m in enqueued_tasks(self.outbox)] == [CONFIRM]
        # When the helper runs it, Then each step runs, the second on the first's result
        ran = run_enqueued_tasks(self.outbox)
        assert [(r.name, r.state) for r in ran] == [(CONFIRM, "SUCCESS"), (SHIP, "SUCCESS")]
        assert Shipment.objects.get().order_id == "o-2"

    def test_a_failing_task_raises_or_is_reported(self) -> None:
        self.fail.delay("o-3")
        # Given a task that fails: by default its error reaches the test
        with pytest.raises(ValueError, match="cannot confirm o-3"):
            run_enqueued_tasks(self.outbox)
        # And with throw=False the failure is a FAILURE result (the row is marked either way)
        self.fail.delay("o-4")
        [failed] = run_enqueued_tasks(self.outbox, throw=False)
        assert (failed.state, str(failed.result)) == ("FAILURE", "cannot confirm o-4")

    def test_a_task_of_another_service_is_refused_by_name(self) -> None:
        # Given a task only routed here (its code lives in another service), sent inside the test
        self.outbox.app.send_task(ELSEWHERE, args=["o-5"])
        assert [m.routing_key for m in enqueued_tasks(self.outbox)] == ["another-service"]
        # Then running it here is refused with its name, not silently skipped
        with pytest.raises(ConfigError, match=ELSEWHERE):
            run_enqueued_tasks(self.outbox)

    def test_a_testcase_is_always_inside_atomic_so_delay_never_raises_there(self) -> None:
        # Given a TestCase's test body: always inside atomic(), unlike a TransactionTestCase, where the
        # default mode raises TransactionRequiredError (tests/django/test_django_enqueue.py)
        assert transaction.get_connection().in_atomic_block
        # When a task is sent without an atomic() of the test's own, Then it is captured as a row
        self.confirm.delay("o-6")
        assert [m.headers["argsrepr"] for m in enqueued_tasks(self.outbox)] == ["('o-6',)"]

    def test_a_task_runs_with_its_message_headers_and_queue_as_on_a_worker(self) -> None:
        # Given a task sent in the test with a header of the caller's own (what carries trace context too),
        # routed to its own queue
        self.whoami.apply_async(headers={"tenant": "t-7"})
        [message] = enqueued_tasks(self.outbox)
        assert (message.headers["tenant"], message.routing_key) == ("t-7", MAIL_QUEUE)
        # When the helper runs it
        [ran] = run_enqueued_tasks(self.outbox)
        # Then the task sees the message's headers and the queue a worker would have taken it from
        assert ran.result == {"tenant": "t-7", "queue": MAIL_QUEUE}
