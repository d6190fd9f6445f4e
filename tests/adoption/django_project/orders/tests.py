"""The team's own tests, run by Django's test runner (``manage.py test``): both kinds of test case write the
test database (``DATABASES["default"]["TEST"]["NAME"]``), never the developer's, and the outbox follows it."""

import os

from django.db import connection
from django.test import TestCase, TransactionTestCase
from proj.celery import outbox

from celery_outbox import Outcome
from celery_outbox.contrib.django.testing import enqueued_tasks, run_enqueued_tasks
from celery_outbox.testing import run_pending
from orders.models import Notification, Order

DEV_DB = os.environ["SHOP_DB_PATH"]


def place(client, order_id, **extra):
    return client.post("/orders", {"id": order_id, **extra}, content_type="application/json")


class OnTheTestDatabase:
    def assert_on_the_test_database(self):
        name = connection.settings_dict["NAME"]
        self.assertEqual(name, DEV_DB + "-test")  # Django's connection: the test database
        self.assertEqual(outbox.sessions.url, f"sqlite:///{name}")  # and the outbox's sessions follow it


class PlaceOrderTest(OnTheTestDatabase, TestCase):
    """A ``TestCase`` never commits: the view's task is a pending row of the test's transaction."""

    def test_the_views_task_is_enqueued_in_the_test_transaction_and_runs_here(self):
        self.assertEqual(place(self.client, "t-1").status_code, 201)
        [message] = enqueued_tasks(outbox)
        self.assertEqual((message.headers["task"], message.headers["argsrepr"]), ("orders.confirm", "('t-1',)"))
        [result] = run_enqueued_tasks(outbox)
        self.assertEqual(result.state, "SUCCESS")
        self.assertEqual(list(Notification.objects.values_list("order_id", flat=True)), ["confirmed:t-1"])
        self.assertEqual(enqueued_tasks(outbox), [])
        self.assert_on_the_test_database()

    def test_a_request_that_fails_leaves_neither_its_order_nor_its_task(self):
        with self.assertRaisesMessage(RuntimeError, "payment declined"):
            place(self.client, "t-2", fail=True)
        self.assertFalse(Order.objects.exists())
        self.assertEqual(enqueued_tasks(outbox), [])


class PlaceOrderCommittedTest(OnTheTestDatabase, TransactionTestCase):
    """A ``TransactionTestCase`` commits: ``run_pending`` relays and runs what the test committed, and only that."""

    def test_run_pending_delivers_the_event_and_runs_the_task_on_the_test_database(self):
        self.assertEqual(place(self.client, "c-1").status_code, 201)
        outcomes = run_pending(outbox)
        self.assertEqual(outcomes, {"notify": [Outcome.PROCESSED], "orders.confirm": [Outcome.PROCESSED]})
        self.assertEqual(sorted(Notification.objects.values_list("order_id", flat=True)), ["c-1", "confirmed:c-1"])
        self.assertEqual(run_pending(outbox), {})
        self.assert_on_the_test_database()

    def test_a_request_that_fails_commits_nothing_to_relay(self):
        with self.assertRaisesMessage(RuntimeError, "payment declined"):
            place(self.client, "c-2", fail=True)
        self.assertEqual(run_pending(outbox), {})
        self.assertFalse(Order.objects.exists() or Notification.objects.exists())
