"""Task receipts in a real ``celery worker`` (prefork) on RabbitMQ and Postgres, SIGKILLed whole while it works:
every message it acked has its receipt (celery_outbox/celery/receipts.py writes the pending batch before any
ack), and the messages it had not acked come back, run, and get theirs.

Plain ``plain.record`` messages carry the outbox's receipt header, published straight to the broker
(tests/tasks/worker_env.py); which messages the dead worker acked is read from the queue itself once the
broker has requeued the rest (no consumer left on it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from kombu import Connection, Exchange, Queue

from celery_outbox.celery.enqueue import publishing_directly
from celery_outbox.inbox.receipts import RECEIPT_HEADER
from celery_outbox.schema import Tables
from tests.tasks import idempotent_app as ia
from tests.tasks.worker_env import Env, task_env

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq, pytest.mark.workers, pytest.mark.chaos, pytest.mark.slow]

TASKS = 40


@pytest.fixture
def env(rabbitmq_url: str, pg_url: str, namespace: str, tmp_path: Path, tables: Tables) -> Iterator[Env]:
    with task_env(broker_url=rabbitmq_url, pg_url=pg_url, namespace=namespace, tmp_path=tmp_path, tables=tables) as e:
        yield e


def receipts_of(env: Env, ids: list[str]) -> set[str]:
    with env.sessions() as s:
        got = s.scalars(sa.select(env.tables.receipts.task_id).where(
            env.tables.receipts.task_id.in_([uuid.UUID(i) for i in ids])))
        return {str(t) for t in got}


def queued_ids(env: Env) -> set[str]:
    """The task ids still on the queue once no consumer holds any (the broker requeued what was unacked)."""
    name = ia.tasks_queue(env.built.settings)
    with Connection(env.settings.broker_url) as conn:
        channel = conn.channel()
        queue = Queue(name, Exchange(name), routing_key=name)(channel)
        deadline = time.monotonic() + 60
        while queue.queue_declare(passive=True).consumer_count:  # a wait, not a timing check
            if time.monotonic() > deadline:
                pytest.fail("the killed worker's consumer is still on the queue")
            time.sleep(0.1)
        ids = set()
        while (message := queue.get(no_ack=False)) is not None:
            ids.add(message.headers["id"])
        channel.close()  # unacked: back on the queue for the next worker
    return ids


def test_a_worker_killed_mid_run_acked_nothing_without_its_receipt_and_the_rest_come_back(env: Env) -> None:
    # Given plain tasks captured by the outbox (the receipt header) and a worker running them
    worker = env.start_worker()
    ids = [str(uuid.uuid4()) for _ in range(TASKS)]
    with publishing_directly(env.built.plain.app):
        for i, tid in enumerate(ids):
            env.built.plain.apply_async(args=[f"r{i}"], task_id=tid, headers={RECEIPT_HEADER: 1})
    env.wait("ten tasks run", lambda s: min(10, ia.effect_count(s, ia.PLAIN)), 10)
    # When the whole worker is SIGKILLed while it works (receipts pending in its main process)
    worker.kill()
    # Then every message it acked (gone from the queue) has its receipt
    acked = [tid for tid in ids if tid not in queued_ids(env)]
    assert len(acked) >= 9, acked
    assert receipts_of(env, acked) == set(acked)
    # And a new worker runs the rest, each of them then with its receipt too
    env.start_worker()
    env.wait("every task run", lambda s: len({k for k in s.scalars(sa.select(ia.effects.c.key).where(
        ia.effects.c.task == ia.PLAIN))}), TASKS)
    env.wait("every receipt", lambda s: len(receipts_of(env, ids)), TASKS)
