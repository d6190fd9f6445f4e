"""Custom Celery events reach an event receiver (what Flower is) through the real broker."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from celery import Celery

from celery_outbox.celery import events
from celeryconfig import Settings, celery_config

pytestmark = [pytest.mark.redis]


def test_unknown_event_type_is_refused(settings: Settings) -> None:
    app = Celery("t", set_as_current=False)
    with pytest.raises(ValueError, match="unknown outbox event type"):
        events.send_event(app, "task-succeeded", x=1)


@pytest.mark.parametrize("etype", events.EVENT_TYPES)
def test_events_reach_a_receiver(settings: Settings, redis_url: str, etype: str) -> None:
    # A Redis database of its own: the shared one carries other tests' worker events.
    url = redis_url.rsplit("/", 1)[0] + "/13"
    app = Celery("t", set_as_current=False)
    app.conf.update(celery_config(settings, url))
    marker = uuid.uuid4().hex
    got: list[dict[str, Any]] = []
    receivers: list[Any] = []
    arrived = threading.Event()

    def on_event(event: dict[str, Any]) -> None:
        if event.get("message_id") == marker:
            got.append(event)
            arrived.set()
            receivers[0].should_stop = True

    def listen() -> None:
        with app.connection_for_read() as conn:
            recv = app.events.Receiver(conn, handlers={etype: on_event})
            receivers.append(recv)
            recv.capture(limit=None, timeout=None, wakeup=False)  # one subscription, until should_stop

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    # Redis fans events out with PUB/SUB: resend until the receiver is subscribed (a wait, not a timing check)
    while not arrived.is_set() and time.monotonic() < deadline:
        if etype == events.DEAD_LETTERED:
            assert events.dead_lettered(app, source="consumer", consumer="billing", message_id=marker,
                                        error="x" * 900, event_type="OrderPlaced", attempts=3)
        elif etype == events.RECONCILED:
            assert events.reconciled(app, kind="task", message_id=marker, target="orders.send_confirmation_email")
        else:
            assert events.duplicate_absorbed(app, consumer="billing", message_id=marker, event_type="OrderPlaced")
        arrived.wait(0.3)
    if receivers:
        receivers[0].should_stop = True
    t.join(timeout=10)
    assert got, "no event arrived"
    e = got[0]
    assert e["type"] == etype and "hostname" in e and "timestamp" in e
    if etype == events.RECONCILED:
        assert (e["kind"], e["target"]) == ("task", "orders.send_confirmation_email")
    else:
        assert e["consumer"] == "billing"
    if etype == events.DEAD_LETTERED:
        assert e["source"] == "consumer" and len(e["error"]) == 500 and e["attempts"] == 3


def test_an_unreachable_broker_never_fails_the_caller(settings: Settings) -> None:
    app = Celery("t", set_as_current=False)
    app.conf.update(celery_config(settings, "redis://127.0.0.1:1/0"))
    app.conf.broker_connection_retry = False
    app.conf.broker_connection_max_retries = 0
    app.conf.broker_transport_options = {"max_retries": 0}
    assert events.duplicate_absorbed(app, consumer="billing", message_id="m") is False
