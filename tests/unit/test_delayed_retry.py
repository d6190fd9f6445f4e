"""Retries on quorum queues take the broker's delay chain (celery/delayed_retry.py); elsewhere they are unchanged.

Celery itself turns the retry's countdown into the chain's routing key: these tests send through Celery's
own ``send_task`` with a recording producer, so they fail if Celery stops rerouting what we hand it.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from celery import Celery

from celery_outbox import Outbox
from celery_outbox.celery import delayed_retry
from celery_outbox.celery.config import celery_config
from celery_outbox.messages import task_name
from celery_outbox.settings import Settings

AMQP = "amqp://guest:guest@127.0.0.1:5672//"
REDIS = "redis://127.0.0.1:6379/0"


def _app(sqlite_url: str, *, broker: str = AMQP, queue_type: str = "quorum") -> Celery:
    settings = Settings(namespace="ns", broker_queue_type=queue_type, database_url=sqlite_url)
    app = Celery("t", set_as_current=False)
    app.conf.update(celery_config(settings, broker, consumers=("shipping",)))
    outbox = Outbox(app, settings=settings)

    @outbox.consumer("OrderPlaced", name="shipping")
    def ship(session: object, event: object) -> None:
        return None

    return app


def _task(app: Celery, routing_key: str, *, eager: bool = False) -> Any:
    request = SimpleNamespace(is_eager=eager, delivery_info={"exchange": "ns.events", "routing_key": routing_key})
    return SimpleNamespace(app=app, request=request)


def _sent(app: Celery, countdown: float, options: dict[str, Any]) -> dict[str, Any]:
    """What Celery's ``send_task`` hands the producer for a retry with these options."""
    sent: list[dict[str, Any]] = []

    def record(producer: Any, name: str, message: Any, **kwargs: Any) -> None:
        sent.append(kwargs)

    with mock.patch.object(type(app.amqp), "send_task_message", new=property(lambda self: record)):
        app.send_task(task_name("shipping"), args=("{}",), countdown=countdown, producer=mock.MagicMock(), **options)
    [kwargs] = sent
    return kwargs


def test_a_retry_on_a_quorum_queue_is_published_into_the_delay_chain(sqlite_url: str) -> None:
    app = _app(sqlite_url)
    countdown, options = delayed_retry.retry_options(_task(app, "ns.shipping"), 2.3)
    assert countdown == 3.0  # whole seconds, rounded up: never earlier than the policy asked
    kwargs = _sent(app, countdown, options)
    assert kwargs["exchange"].name == "celery_delayed_27"
    assert kwargs["routing_key"] == "0." * 26 + "1.1.ns.shipping"  # 3 in 28 bits, then the queue


def test_a_retry_that_came_through_the_chain_goes_back_to_the_same_queue(sqlite_url: str) -> None:
    app = _app(sqlite_url)
    came_back = "0." * 27 + "1.ns.shipping"  # delivered from celery_delayed_delivery after a 1 s wait
    countdown, options = delayed_retry.retry_options(_task(app, came_back), 4)
    assert options["queue"].name == "ns.shipping"
    assert _sent(app, countdown, options)["routing_key"] == "0." * 25 + "1.0.0.ns.shipping"


def test_a_retry_without_a_wait_goes_to_the_chain_end_bound_to_the_queue(sqlite_url: str) -> None:
    app = _app(sqlite_url)
    countdown, options = delayed_retry.retry_options(_task(app, "ns.shipping"), 0.0)
    assert countdown == 0.0
    queue = options["queue"]
    assert (queue.exchange.name, queue.exchange.type, queue.routing_key) == ("celery_delayed_delivery", "topic",
                                                                            "ns.shipping")
    assert queue.queue_arguments == app.amqp.queues["ns.shipping"].queue_arguments  # no PRECONDITION_FAILED


@pytest.mark.parametrize(("broker", "queue_type", "eager"), [(AMQP, "classic", False), (REDIS, "classic", False),
                                                             (AMQP, "quorum", True)])
def test_elsewhere_a_retry_is_left_as_celery_sends_it(sqlite_url: str, broker: str, queue_type: str,
                                                      eager: bool) -> None:
    app = _app(sqlite_url, broker=broker, queue_type=queue_type)
    assert delayed_retry.retry_options(_task(app, "ns.shipping", eager=eager), 2.3) == (2.3, {})


def test_a_queue_the_app_does_not_declare_is_left_alone(sqlite_url: str) -> None:
    app = _app(sqlite_url)
    assert delayed_retry.retry_options(_task(app, "someone.else"), 2) == (2, {})


def test_the_worker_step_binds_only_consumed_quorum_queues(sqlite_url: str) -> None:
    app = _app(sqlite_url)
    assert sorted(q.name for q in delayed_retry.consumed_quorum_queues(app)) == ["ns.relay", "ns.shipping"]
    app.amqp.queues.select(["ns.shipping"])
    assert [q.name for q in delayed_retry.consumed_quorum_queues(app)] == ["ns.shipping"]
    assert [q.name for q in delayed_retry.consumed_quorum_queues(_app(sqlite_url, queue_type="classic"))] == []


def test_celerys_warning_is_dropped_for_the_librarys_exchanges_only(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("kombu.transport.native_delayed_delivery")
    before = list(logger.filters)
    try:
        delayed_retry.quiet_own_exchanges(("ns.events", "ns.relay"))
        delayed_retry.quiet_own_exchanges(("ns.events", "ns.relay"))  # once
        assert len(logger.filters) == len(before) + 1
        with caplog.at_level(logging.WARNING, logger=logger.name):
            for name in ("ns.events", "ns.relay", "theirs"):
                logger.warning(f"Exchange {name} is a direct exchange and native delayed delivery do not support "
                               "direct exchanges.\nETA tasks published to this exchange will block the worker.")
        assert [r.getMessage().split()[1] for r in caplog.records] == ["theirs"]
    finally:
        logger.filters[:] = before


def test_a_batch_consumers_retry_takes_the_chain_too(sqlite_url: str) -> None:
    """A batch consumer re-sends a failed message with ``apply_async`` (celery/batch_tasks.py), by its queue."""
    app = _app(sqlite_url)
    countdown, options = delayed_retry.queue_retry_options(app, app.amqp.queues["ns.shipping"], 1.5)
    assert countdown == 2.0
    assert _sent(app, countdown, options)["routing_key"] == "0." * 26 + "1.0.ns.shipping"
    assert delayed_retry.queue_retry_options(app, None, 1.5) == (1.5, {})
