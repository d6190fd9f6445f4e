"""The benches' worker app: the reference deployment's app, plus hop timestamps and plain-Celery twins.

``celery -A bench._worker worker`` runs ``relay.factory.create_outbox()`` (settings from ``OUTBOX_*``,
consumers from ``consumers.register``, the e-mail task from ``orders.tasks.register``, so it follows
whatever the deployment declares) and adds:

- for every declared consumer, a plain task ``bench.plain.<consumer>`` on the same queue that runs the
  consumer's own ``prepare`` + handler in one session and commits: the same effect with no inbox (what
  ``.delay()`` after commit would run);
- a plain twin of the confirmation e-mail task (``orders.send_confirmation_email``, orders/tasks.py),
  ``bench.plain.send_confirmation_email`` on the same ``<namespace>.email`` queue: the same
  ``send_confirmation`` through the same provider, keyed by its own task id, no inbox row;
- ``BENCH_WORKER_CONF`` (a JSON object) overrides Celery settings, to measure one knob against the
  deployment's default in the same bench;
- when ``BENCH_HOPS_DIR`` is set, one JSON line per task and stage, written by the process that saw it:
  ``recv`` (``task_received``, the worker parent took the message off the broker), ``pre``
  (``task_prerun``, a pool process starts it; with the message id and task name: the envelope's, else
  the task id, which is the outbox message id of an enqueued task such as the e-mail) and ``post``
  (``task_postrun``, its commit is done), joined on the task id.

Nothing here is library code: the relay and the consumers are untouched.
"""

from __future__ import annotations

import functools
import json
import os
import time
import uuid
from typing import IO, Any

import sqlalchemy as sa
from celery import Celery, signals

from celery_outbox import Envelope, Outbox
from celery_outbox.celery import batch_tasks
from celery_outbox.celery.batch_tasks import run_batch as _run_batch
from celery_outbox.inbox.claim import NOW_KEY

PLAIN_PREFIX = "bench.plain."
PLAIN_EMAIL = f"{PLAIN_PREFIX}send_confirmation_email"  # the plain twin of orders.send_confirmation_email
HOPS_ENV = "BENCH_HOPS_DIR"
CONF_ENV = "BENCH_WORKER_CONF"  # JSON object of Celery settings laid over the deployment's (knob experiments)
TOUCH = "bench.touch"  # bench/saturated.py's task: one row insert, sent by .delay() with or without the outbox
TOUCH_QUEUE = "email"  # a queue every bench worker consumes (the e-mail task's)
_TABLES = sa.MetaData()
# The touch task's effect, and the business row its sender commits before (plain) or with (outbox) it.
TOUCHED = sa.Table("bench_touched", _TABLES, sa.Column("id", sa.String(80), primary_key=True))
ITEMS = sa.Table("bench_items", _TABLES, sa.Column("id", sa.String(80), primary_key=True))


def create_touch_tables(engine: sa.Engine) -> None:
    _TABLES.create_all(engine)


def add_touch_task(app: Celery, sessions: Any, *, queue: str) -> Any:
    """``bench.touch(key)``: insert one ``bench_touched`` row and commit; the same body whichever way it was
    sent (``.delay()`` inside ``outbox.transaction`` or a plain ``.delay()`` after the commit)."""
    def touch(key: str) -> None:
        with sessions()() as s:
            s.execute(TOUCHED.insert().values(id=key))
            s.commit()

    return app.task(name=TOUCH, queue=queue, acks_late=True, ignore_result=True, shared=False)(touch)


def plain_task_name(consumer: str) -> str:
    return f"{PLAIN_PREFIX}{consumer}"


def envelope_dict(*, message_id: uuid.UUID, payload: dict[str, Any], entity_key: str, created_at_ms: int) -> dict[str, Any]:
    """The plain task's argument: the same fields an outbox envelope carries (JSON)."""
    return {"message_id": str(message_id), "type": "OrderPlaced", "payload": payload,
            "headers": {"entity_key": entity_key, "entity_version": 1}, "created_at_ms": created_at_ms}


def add_plain_tasks(outbox: Outbox) -> None:
    """One plain task per declared consumer: prepare + handler + commit, no inbox, no retry machinery."""
    app = outbox.app
    for spec in outbox.registry:
        def run(body: dict[str, Any], _spec: Any = spec) -> None:
            env = Envelope(message_id=uuid.UUID(body["message_id"]), type=body["type"], payload=body["payload"],
                           headers=dict(body["headers"]), created_at_ms=int(body["created_at_ms"]))
            with outbox.sessions()() as s:
                s.info[NOW_KEY] = outbox.clock.now_ms()
                if _spec.prepare is not None:
                    _spec.prepare(s, env)
                _spec.handler(s, env)
                s.commit()

        app.task(name=plain_task_name(spec.name), acks_late=True, ignore_result=True, shared=False)(run)
    add_plain_email_task(outbox)


def add_plain_email_task(outbox: Outbox) -> None:
    """The e-mail task without the outbox: ``send_confirmation`` through the deployment's provider (the fake,
    which commits one ``sent_emails`` row per key), keyed by this task's id like the real task; no inbox."""
    from orders.tasks import fake_provider, send_confirmation

    def run(task: Any, body: dict[str, Any]) -> None:
        with outbox.sessions()() as s:
            send_confirmation(s, fake_provider(s), task_id=str(task.request.id), order_id=body["order_id"])

    outbox.app.task(name=PLAIN_EMAIL, bind=True, acks_late=True, ignore_result=True, shared=False)(run)


class HopLog:
    """Append-only JSON lines, one file per process (no interleaving between processes)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._file: IO[str] | None = None
        self._pid = 0

    def write(self, kind: str, task_id: Any, **extra: str) -> None:
        t = time.time() * 1000.0
        if self._file is None or self._pid != os.getpid():  # a forked pool process opens its own file
            self._pid = os.getpid()
            self._file = open(os.path.join(self.directory, f"hops-{self._pid}.jsonl"), "a", buffering=1)  # noqa: SIM115
        self._file.write(json.dumps({"k": kind, "id": str(task_id), "t": t, **extra}) + "\n")


def message_id_of(args: Any, task_id: Any) -> str:
    """The delivery's message id: from the task's one argument (the envelope, as JSON text or a dict), else
    the task id (an enqueued task's outbox row carries its task id as message id, enqueue.py)."""
    try:
        body = args[0]
        if isinstance(body, str):
            body = json.loads(body)
        return str(body["message_id"])
    except (LookupError, TypeError, ValueError):
        return str(task_id)


def install_hops(directory: str) -> None:
    """Record, per task id, when the parent received it and when a pool process started and ended it.

    The outbox's consumer tasks are rebuilt by the library's strategy with canonical headers only, so
    the message id comes from the argument, read in the pool process (task_prerun), not the parent.
    """
    log = HopLog(directory)

    def on_received(request: Any = None, **_: Any) -> None:
        log.write("recv", getattr(request, "id", None))

    def on_prerun(task_id: Any = None, task: Any = None, args: Any = None, **_: Any) -> None:
        log.write("pre", task_id, mid=message_id_of(args, task_id), task=str(getattr(task, "name", "")))

    def on_postrun(task_id: Any = None, **_: Any) -> None:
        log.write("post", task_id)

    signals.task_received.connect(on_received, weak=False)
    signals.task_prerun.connect(on_prerun, weak=False)
    signals.task_postrun.connect(on_postrun, weak=False)
    # A batch consumer's batch runs as one pool job, not as tasks: no task_prerun/postrun per message.
    # The worker's main process sends the job by looking ``run_batch`` up in its module, and the prefork
    # pool pickles a reference to the function, so the bench's twin below runs instead (a forked pool
    # process finds it, and the log, in this module).
    global _BATCH_HOPS
    _BATCH_HOPS = log
    batch_tasks.run_batch = run_batch_with_hops


_BATCH_HOPS: HopLog | None = None


def run_batch_with_hops(task_name: str, items: list[Any], retries: list[int]) -> Any:
    """``batch_tasks.run_batch``, with a ``pre`` and a ``post`` hop per message of the batch."""
    log = _BATCH_HOPS
    if log is not None:
        for item in items:
            log.write("pre", item.request_id, mid=message_id_of([item.body], item.request_id), task=task_name)
    try:
        return _run_batch(task_name, items, retries)
    finally:
        if log is not None:
            for item in items:
                log.write("post", item.request_id)


def build() -> Outbox:
    from relay.factory import create_outbox

    outbox = create_outbox()
    outbox.app.conf.update(json.loads(os.environ.get(CONF_ENV) or "{}"))
    add_plain_tasks(outbox)
    add_touch_task(outbox.app, outbox.sessions, queue=outbox.settings.queue_name(TOUCH_QUEUE))
    directory = os.environ.get(HOPS_ENV)
    if directory:
        install_hops(directory)
    return outbox


@functools.cache
def _app() -> Celery:
    return build().app


def __getattr__(name: str) -> Any:
    """``celery -A bench._worker`` looks up ``app``: built on first access, not at import."""
    if name == "app":
        return _app()
    raise AttributeError(name)


# -- the plain twin's sending side (bench/e2e_latency.py, bench/_plain_web.py) -----------------------
def plain_celery(settings: Any, *, confirm_publish: bool | None = None, sent_events: bool | None = None) -> Celery:
    """A plain Celery app with the deployment's Celery configuration and no ``Outbox`` on it (the outbox
    app refuses a ``send_task`` outside a transaction): what an application without the outbox runs.
    ``confirm_publish`` (RabbitMQ) overrides the deployment's publisher confirms (on) for the sends;
    ``sent_events`` its ``task_send_sent_event`` (on; the relay sends no task-sent event)."""
    from celeryconfig import celery_config

    app = Celery("plain", set_as_current=False)
    conf = celery_config(settings, settings.broker_url)
    if confirm_publish is not None:
        conf["broker_transport_options"] = {**conf["broker_transport_options"], "confirm_publish": confirm_publish}
    if sent_events is not None:
        conf["task_send_sent_event"] = sent_events
    app.conf.update(conf)
    return app


def place_plain_order(session: Any, req: Any, *, now_ms: int) -> None:
    """``place_order`` without the outbox row: the order and its lines, one commit."""
    from orders.models import Order, OrderLine

    session.add(Order(id=req.order_id, customer_id=req.customer_id, email=req.email, currency=req.currency,
                      total_cents=req.total_cents, status="placed", created_at_ms=now_ms,
                      lines=[OrderLine(sku=li.sku, quantity=li.quantity, unit_price_cents=li.unit_price_cents)
                             for li in req.lines]))
    session.commit()


def send_plain(app: Celery, settings: Any, consumers: Any, req: Any, *, now_ms: int) -> str:
    """After the commit, one task per consumer and the e-mail task (what ``.delay()`` does), on the queues
    the deployment uses; returns the message id they carry."""
    from orders.service import order_placed_payload
    from orders.tasks import QUEUE

    mid = uuid.uuid4()
    body = envelope_dict(message_id=mid, payload=order_placed_payload(req), entity_key=f"order:{req.order_id}",
                         created_at_ms=now_ms)
    for consumer in consumers:
        app.send_task(plain_task_name(consumer), args=[body], queue=settings.queue_name(consumer))
    app.send_task(PLAIN_EMAIL, args=[{"message_id": str(mid), "order_id": req.order_id}],
                  queue=settings.queue_name(QUEUE))
    return str(mid)
