"""The worker side of a batch consumer without a worker (celery/batch_tasks.py): the buffer flushes at
``batch_size`` or ``batch_wait_ms`` as ONE pool job, and each message is settled on its own afterwards."""

from __future__ import annotations

import json
import uuid
from typing import Any

from celery_outbox.celery.batch_tasks import Settled, _Buffer, _lost, _settle, run_batch
from celery_outbox.inbox.outcome import Outcome


class Entry:
    def __init__(self, fn: Any) -> None:
        self.fn, self.cancelled = fn, False

    def cancel(self) -> None:
        self.cancelled = True


class Timer:
    def __init__(self) -> None:
        self.entries: list[tuple[float, Entry]] = []

    def call_after(self, secs: float, fn: Any) -> Entry:
        entry = Entry(fn)
        self.entries.append((secs, entry))
        return entry


class Pool:
    def __init__(self) -> None:
        self.jobs: list[dict[str, Any]] = []

    def apply_async(self, fn: Any, args: tuple[Any, ...], **kwargs: Any) -> None:
        self.jobs.append({"fn": fn, "args": args, **kwargs})


class Consumer:
    def __init__(self) -> None:
        self.timer, self.pool = Timer(), Pool()


class Task:
    name = "outbox.consumer.search"
    outbox_batch_size = 3
    outbox_batch_wait_ms = 50
    soft_time_limit, time_limit = 18.0, 20.0


class Request:
    task = Task()

    def __init__(self, order: str, *, retries: int = 0, redelivered: bool = False) -> None:
        self.message_id = str(uuid.uuid4())
        self.args = [json.dumps({"message_id": self.message_id, "type": "OrderPlaced", "payload": {"o": order}})]
        self.id = str(uuid.uuid4())
        self.request_dict = {"retries": retries}
        self.delivery_info = {"redelivered": redelivered}
        self.settled: list[tuple[str, bool]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []

    def acknowledge(self) -> None:
        self.settled.append(("ack", False))

    def reject(self, requeue: bool = False) -> None:
        self.settled.append(("reject", requeue))

    def send_event(self, type: str, **fields: Any) -> None:
        self.events.append((type, fields))


def test_the_buffer_flushes_one_pool_job_at_batch_size_and_cancels_its_timer() -> None:
    consumer = Consumer()
    buffer = _Buffer(Task(), consumer)
    requests = [Request("a"), Request("b", retries=2), Request("c", redelivered=True), Request("d")]
    for r in requests[:3]:
        buffer.add(r)
    # Then the third request flushed the batch: one job, under the consumer's time limits
    assert len(consumer.pool.jobs) == 1
    job = consumer.pool.jobs[0]
    assert (job["fn"], job["soft_timeout"], job["timeout"]) == (run_batch, 18.0, 20.0)
    name, items, retries = job["args"]
    assert name == Task.name and [i.request_id for i in items] == [r.id for r in requests[:3]]
    assert [(i.first_delivery, i.redelivered) for i in items] == [(True, False), (False, False), (True, True)]
    assert retries == [0, 2, 0]
    assert [e.cancelled for _, e in consumer.timer.entries] == [True]  # the wait of the first one, no longer needed
    assert all(r.events == [("task-started", {})] for r in requests[:3])
    # When one more arrives, Then it waits for batch_wait_ms, and the timer flushes it alone
    buffer.add(requests[3])
    assert len(consumer.pool.jobs) == 1
    secs, _ = consumer.timer.entries[-1]
    assert secs == 0.05
    buffer.on_timer()
    assert len(consumer.pool.jobs) == 2 and [i.request_id for i in consumer.pool.jobs[1]["args"][1]] == [requests[3].id]
    buffer.on_timer()  # a timer with nothing left to flush sends nothing
    assert len(consumer.pool.jobs) == 2


def test_each_message_of_a_finished_batch_is_settled_on_its_own() -> None:
    batch = [Request(x) for x in "abcde"]
    _settle(batch, [
        Settled(outcome=Outcome.PROCESSED.value, deliveries=1),
        Settled(outcome=Outcome.DUPLICATE.value, deliveries=1),
        Settled(outcome=Outcome.RETRY.value, deliveries=1, error="ValueError: no"),  # its copy published
        Settled(outcome=Outcome.DEAD_LETTERED.value, deliveries=3, error="ValueError: no"),
        Settled(outcome=Outcome.RETRY.value, deliveries=1, error="E", requeue=True),  # the copy could not be published
    ], runtime=0.25)
    assert [r.settled for r in batch] == [[("ack", False)], [("ack", False)], [("ack", False)], [("reject", False)],
                                          [("reject", True)]]
    assert batch[0].events == [("task-succeeded", {"result": "'processed'", "runtime": 0.25})]
    assert batch[1].events == [("task-succeeded", {"result": repr(f"duplicate of {batch[1].message_id}"),
                                                   "runtime": 0.25})]
    assert batch[2].events == [("task-retried", {"exception": "RedeliveryError(ValueError: no)", "traceback": ""})]
    (kind, fields), = batch[3].events
    assert kind == "task-failed" and fields["exception"] == (
        "DeadLettered(dead-lettered for outbox.consumer.search after 3 deliveries: ValueError: no)")


def test_a_lost_batch_requeues_every_message() -> None:
    batch = [Request(x) for x in "abc"]
    _lost(batch, RuntimeError("WorkerLostError"))
    assert [r.settled for r in batch] == [[("reject", True)]] * 3
