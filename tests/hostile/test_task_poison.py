"""Hostile broker input on the TASK path, against one real ``celery worker`` per broker (Redis, RabbitMQ).

Raw messages are published with kombu (no relay, no Celery client) onto the queue of an
``@outbox.task`` (``idem.record``, the shape of the deployment's e-mail task), onto a plain captured
task's queue (``plain.record``) and, naming a task no worker registers, onto both. Before the
worker-wide gate (celery_outbox/celery/gate.py) a JSON object body killed the worker with
"Unrecoverable error" (every restarted worker died on it), a 5,000-deep body was dropped, and the
other shapes left only a log line. Now, for every shape: the worker stays alive, the good messages
behind run, the bad one is a dead letter under ``task:<name>`` with its raw bytes, and a dead letter
of a well-formed task message is replayed with the CLI and runs once.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kombu import Connection, Exchange, Producer, Queue

from celery_outbox.celery.gate import UNNAMED
from celery_outbox.celery.strategy import body_limit
from celery_outbox.inbox.dead_letters import body_bytes
from celery_outbox.inbox.task_keys import task_key
from celery_outbox.schema import Tables
from devtools.processes import settings_env
from tests.tasks import idempotent_app as ia
from tests.tasks.worker_env import OUTBOX_CLI, ROOT, Env, task_env

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.rabbitmq, pytest.mark.workers, pytest.mark.slow]

UNKNOWN = "no.such.task"


@dataclass
class Case:
    name: str
    task: str | None  # the task header (None: no task header at all)
    queue: str  # "tasks" or "plain"
    body: bytes
    content_type: str = "application/json"
    content_encoding: str = "utf-8"
    headers: dict[str, Any] = field(default_factory=dict)
    task_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    replay_key: str | None = None  # a well-formed call: its replay must run it once, with this key

    def all_headers(self) -> dict[str, Any]:
        base: dict[str, Any] = {"lang": "py", "id": self.task_id, "root_id": self.task_id, "retries": 0}
        if self.task is not None:
            base["task"] = self.task
        return {**base, **self.headers}

    @property
    def dead_letter_key(self) -> str:
        return task_key(self.task if self.task is not None else UNNAMED)


def call(*args: Any, kwargs: Any = None, embed: Any = None) -> bytes:
    return json.dumps([list(args), {} if kwargs is None else kwargs, embed]).encode()


def shapes(task: str, queue: str, tag: str) -> list[Case]:
    """Every hostile shape, for one task on one queue."""
    deep = b"[" * 5000 + b"]" * 5000
    foreign = {"callbacks": [{"task": "celery.backend_cleanup", "args": [], "kwargs": {}, "options": {}}]}
    return [
        Case("a JSON object body", task, queue, b'{"a": 1}'),
        Case("5,000 levels deep", task, queue, b"[[" + deep + b"], {}, null]"),
        Case("pickle content type", task, queue, b"\x80\x04K\x01.", content_type="application/x-python-serialize",
             content_encoding="binary"),
        Case("latin-1 encoding", task, queue, call("\xe9"), content_encoding="latin-1"),
        Case("not UTF-8", task, queue, b'[["\xff\xfe"], {}, null]'),
        Case("not a list", task, queue, b'"x"'),
        Case("wrong arity", task, queue, call("a", "b", "c")),
        Case("kwargs not an object", task, queue, b'[["a"], [1], null]'),
        Case("embed with a foreign callback", task, queue, call(f"{tag}-cb", embed=foreign)),
        Case("huge", task, queue, b'[["' + b"x" * (1024 * 1024) + b'"], {}, null]'),
        Case("task id not a UUID", task, queue, call(f"{tag}-id"), task_id="not-a-uuid"),
        Case("NUL in an argument", task, queue, b'[["a\\u0000"], {}, null]'),
        Case("lone surrogate in an argument", task, queue, b'[["\\ud800"], {}, null]'),
        Case("ETA not a date", task, queue, call(f"{tag}-eta"), headers={"eta": "not a date"},
             replay_key=f"{tag}-eta"),
        Case("time limit not a number", task, queue, call(f"{tag}-tl"), headers={"timelimit": ["x", None]},
             replay_key=f"{tag}-tl"),
    ]


def cases() -> list[Case]:
    out = [*shapes(ia.RECORD, "tasks", "r"), *shapes(ia.PLAIN, "plain", "p")]
    out += [
        Case("unknown task, well formed", UNKNOWN, "tasks", call("u1")),
        Case("unknown task on the plain queue", UNKNOWN, "plain", b'{"a": 1}'),
        Case("no task header", None, "tasks", call("n1")),
        Case("no task header, not JSON", None, "plain", b"\x00\x01 garbage"),
    ]
    return out


@pytest.fixture(params=["redis", "rabbitmq"])
def env(request: pytest.FixtureRequest, pg_url: str, namespace: str, tmp_path: Path, tables: Tables) -> Iterator[Env]:
    broker_url: str = request.getfixturevalue(f"{request.param}_url")
    with task_env(broker_url=broker_url, pg_url=pg_url, namespace=namespace, tmp_path=tmp_path, tables=tables) as e:
        plain = plain_queue(e)
        try:
            yield e
        finally:
            with Connection(broker_url) as conn:
                plain(conn.channel()).delete()


def plain_queue(env: Env) -> Queue:
    name = ia.plain_queue(env.built.settings)
    return Queue(name, Exchange(name), routing_key=name, durable=True)


def test_every_hostile_task_message_is_a_dead_letter_and_the_worker_lives(env: Env) -> None:
    queues = {"tasks": Queue(ia.tasks_queue(env.built.settings), Exchange(ia.tasks_queue(env.built.settings)),
                             routing_key=ia.tasks_queue(env.built.settings), durable=True),
              "plain": plain_queue(env)}
    all_cases = cases()
    worker = env.start_worker(extra_queues=[queues["plain"].name])
    # Given every hostile shape on the @outbox.task queue and on a plain task's queue, unknown tasks too
    with Connection(env.settings.broker_url) as conn:
        channel = conn.channel()
        for q in queues.values():
            q(channel).declare()
        producer = Producer(channel)
        for case in all_cases:
            q = queues[case.queue]
            producer.publish(case.body, exchange=q.exchange, routing_key=q.routing_key, headers=case.all_headers(),
                             content_type=case.content_type, content_encoding=case.content_encoding,
                             delivery_mode=2)
    # And good messages of both tasks behind them
    env.send(env.built.record, "good-r", task_id=str(uuid.uuid4()))
    with Connection(env.settings.broker_url) as conn:
        q = queues["plain"]
        Producer(conn.channel()).publish(call("good-p"), exchange=q.exchange, routing_key=q.routing_key,
                                         headers=Case("good", ia.PLAIN, "plain", b"").all_headers(),
                                         content_type="application/json", content_encoding="utf-8", delivery_mode=2)
    letters = env.tables.dead_letters
    env.wait("every hostile message dead-lettered and both good ones run",
             lambda s: (s.execute(sa.select(sa.func.count()).select_from(letters)).scalar_one(),
                        ia.effect_count(s, ia.RECORD, "good-r"), ia.effect_count(s, ia.PLAIN, "good-p")),
             (len(all_cases), 1, 1), timeout_s=180)
    # Then the worker is alive and never hit an unrecoverable error
    assert worker.alive, env.logs()
    assert "Unrecoverable error" not in env.logs()
    # And each hostile message is one dead letter under its task's key, its raw bytes kept
    with env.sessions() as s:
        rows = list(s.execute(sa.select(letters)).scalars())
        assert ia.effect_count(s, ia.RECORD) + ia.effect_count(s, ia.PLAIN) == 2  # nothing hostile ran
    for case in all_cases:  # every byte, the huge ones too (a replay sends what was received)
        found = [r for r in rows if r.consumer == case.dead_letter_key and body_bytes(r.body) == case.body]
        assert len(found) == 1, f"{case.name} ({case.task}, {case.queue}): {[(r.consumer, r.last_error) for r in rows]}"
        assert found[0].delivery_count == 1 and found[0].last_error, case.name
        if case.task_id != "not-a-uuid":
            assert found[0].message_id == case.task_id, case.name
    huge = [r for r in rows if "over the limit" in r.last_error]
    assert len(huge) == 2 and body_limit(env.built.settings) < 1024 * 1024
    # When an operator replays the dead letters of the well-formed calls with the CLI
    replayable = {c.task_id: c for c in all_cases if c.replay_key}
    ids = [f"consumer:{r.id}" for r in rows if r.message_id in replayable]
    assert len(ids) == len(replayable)
    cli_env = settings_env(env.settings, broker_url=env.settings.broker_url)
    done = subprocess.run([OUTBOX_CLI, "-A", "tests.tasks.idempotent_app:outbox", "dead-letters", "replay", *ids],
                          cwd=ROOT, env=cli_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    # Then each runs once, as the same task (and a second replay is refused as already replayed)
    expected = tuple(1 for _ in replayable)
    env.wait("each replayed call's effect, once",
             lambda s: tuple(ia.effect_count(s, c.task or "", c.replay_key) for c in replayable.values()), expected)
    again = subprocess.run([OUTBOX_CLI, "-A", "tests.tasks.idempotent_app:outbox", "dead-letters", "replay", *ids],
                           cwd=ROOT, env=cli_env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout.count("already replayed") == len(ids), again.stdout + again.stderr
    with env.sessions() as s:
        assert tuple(ia.effect_count(s, c.task or "", c.replay_key) for c in replayable.values()) == expected
    assert worker.alive, env.logs()
