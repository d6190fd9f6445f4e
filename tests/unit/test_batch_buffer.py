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
    num_processes = 1

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


def test_a_trickle_goes_at_once_and_batches_gather_while_the_pool_is_busy() -> None:
    consumer = Consumer()  # a pool of one process
    buffer = _Buffer(Task(), consumer)
    requests = [Request("a"), Request("b", retries=2), Request("c", redelivered=True), Request("d"), Request("e"),
                Request("f"), Request("g")]
    # A message that finds the pool free goes at once, alone: a trickle waits for nothing
    buffer.add(requests[0])
    assert [[i.request_id for i in j["args"][1]] for j in consumer.pool.jobs] == [[requests[0].id]]
    job = consumer.pool.jobs[0]
    assert (job["fn"], job["soft_timeout"], job["timeout"]) == (run_batch, 18.0, 20.0)
    assert consumer.timer.entries == []
    # While it runs, the next ones gather; the third makes batch_size and goes (the pool queues it)
    for r in requests[1:4]:
        buffer.add(r)
    assert len(consumer.pool.jobs) == 2
    name, items, retries = consumer.pool.jobs[1]["args"]
    assert name == Task.name and [i.request_id for i in items] == [r.id for r in requests[1:4]]
    assert [(i.first_delivery, i.redelivered) for i in items] == [(False, False), (True, True), (True, False)]
    assert retries == [2, 0, 0]
    assert [(secs, e.cancelled) for secs, e in consumer.timer.entries] == [(0.05, True)]  # its wait, not needed
    assert all(r.events == [("task-started", {})] for r in requests[:4])
    # When a batch finishes, what gathered meanwhile goes at once
    buffer.add(requests[4])
    assert len(consumer.pool.jobs) == 2
    consumer.pool.jobs[0]["callback"]([Settled(outcome=Outcome.PROCESSED.value, deliveries=1)])
    assert requests[0].settled == [("ack", False)]
    assert [i.request_id for i in consumer.pool.jobs[2]["args"][1]] == [requests[4].id]
    # And while the pool stays busy, batch_wait_ms bounds the wait of what gathers
    buffer.add(requests[5])
    buffer.add(requests[6])
    assert len(consumer.pool.jobs) == 3
    secs, _ = consumer.timer.entries[-1]
    assert secs == 0.05
    buffer.on_timer()
    assert [i.request_id for i in consumer.pool.jobs[3]["args"][1]] == [requests[5].id, requests[6].id]
    buffer.on_timer()  # a timer with nothing left to send sends nothing
    assert len(consumer.pool.jobs) == 4
    # A lost batch frees its slot too
    consumer.pool.jobs[1]["error_callback"](RuntimeError("WorkerLostError"))
    assert [r.settled for r in requests[1:4]] == [[("reject", True)]] * 3
    assert buffer.running == 2


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
