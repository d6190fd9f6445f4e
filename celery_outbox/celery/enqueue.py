"""Transactional enqueue: ``task.delay()`` inside the caller's transaction becomes an outbox row.

The capture sits at the one door every Celery task message goes through, the app's
``amqp.send_task_message(producer, name, message, **options)``, wrapped once per ``Outbox``. By then
Celery has done everything it does for a send: the task id, ``task_routes``, ``countdown`` turned into
an absolute ``eta`` (so a late relay never shifts it), ``expires``, ``priority``, headers, the chain or
callbacks in the body's embed. The wrapper lets Celery's own sender run against a producer that only
records what it would publish (exchange, routing key, declared queue, properties, headers, body), so
the row holds exactly the message Celery would have sent, and writes it into the bound transaction
instead of the broker. The relay publishes it later (``messages.task_row_message``) as that same
protocol-2 message, with the task id as the outbox message id.

Where the row goes, in order:

1. ``with outbox.transaction(session):`` (a context variable; nesting allowed, the innermost wins) or
   ``outbox.enqueue(session, signature)``: the SQLAlchemy ``session``;
2. an ambient transaction the outbox was given (``Outbox(ambient=...)``; ``DjangoOutbox`` gives its own:
   inside ``transaction.atomic()``, through the Django ORM);
3. none (a script, a shell, a command, code after the commit): ``Settings.enqueue_outside_transaction``
   says ``"own_transaction"`` (the default: the row commits at once in a short transaction of its own
   on the outbox's engine, ``OwnTransactionWriter``; durable across a broker outage and a crash, but not
   atomic with anything the caller wrote before), ``"raise"`` (the strict mode:
   ``TransactionRequiredError``, nothing sent) or ``"publish"`` (sent at once, as plain Celery would).

Never captured, always sent as Celery sends them: the library's own tasks (``celery_outbox.*``, the
consumer tasks), Celery's built-ins (``celery.*``), names in ``Settings.enqueue_exclude``, a retry a
running worker task sends of itself (``Task.retry``: the failed attempt's transaction rolls back, the
retry must still go), anything the app sends inside ``publishing_directly(app)``, and, outside a bound transaction,
anything sent from inside a running worker task (chain steps, callbacks) or by ``celery beat``.

Refused with a clear error, inside the caller's transaction and before anything is written: arguments
or headers that are not plain JSON (never pickled), a message over ``max_message_bytes``, a chord (its
counter lives in the result backend, outside the transaction), a task this app neither registers nor
routes, a non-JSON serializer or a compression, a task id the caller chose that an outbox row already
holds, and everything ``celery_outbox.task_rules`` refuses (the same table the worker's gate applies:
arguments nested deeper than ``max_json_depth``, NUL or lone surrogates, a task id that is not a UUID,
callbacks naming tasks the outbox does not carry, arguments that do not fit the task's signature). A
UUID task id in another spelling (upper case, no dashes, braces, ``urn:uuid:``) is normalised to the
canonical form, as the worker's gate does.

Time lives in the database (docs/scheduled.md): a task whose ``eta`` (or ``countdown``) is more than
``Settings.enqueue_hold_eta_after_ms`` ahead is written with ``next_attempt_at_ms`` = its eta and its
message's ``eta`` removed; the relay publishes it when due, so no worker holds it unacked until then
(Redis would redeliver it after the visibility timeout, a quorum queue cannot hold it the classic way,
a worker restart would drop it back on the queue). A nearer eta is left in the message, as Celery sent it.

A task with a dedup key (``apply_async(headers={"outbox_dedup_key": K, "outbox_dedup_on_conflict":
"keep" | "replace"})``, or ``outbox.enqueue(..., dedup_key=K)``) is written so that at most one pending
row holds K (celery_outbox/dedup.py); the two headers never reach the message.

The capture's state (the bound sessions, ``publishing_directly``, whether the process runs beat) is its
``Outbox``'s own, on the ``Interceptor``: two Outboxes in one process share none of it (no module-level state).

The reused-id check costs one indexed lookup, and only for an id the caller chose (``task_id=...``,
or one Celery froze for a canvas): Celery's own ids are fresh uuid4s and never collide.

One module, though long: the capture is one door (``send_task_message``) and the rules above apply at it in
the order written here; split, that order would be spread over files.
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from types import MappingProxyType
from typing import Any, Protocol

import sqlalchemy as sa
from celery import signals
from celery.backends.base import Backend
from celery.utils.time import maybe_make_aware
from kombu import Exchange, Queue
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from celery_outbox import dedup, tracing
from celery_outbox.celery import beat
from celery_outbox.errors import (
    ConfigError,
    DatabaseError,
    MalformedMessageError,
    SerializationError,
    TransactionRequiredError,
    ValidationError,
)
from celery_outbox.inbox.receipts import RECEIPT_HEADER
from celery_outbox.messages import TASK_KIND, QueueSpec, check_size, encode_json, task_name
from celery_outbox.schema import Tables
from celery_outbox.task_route import (
    MAX_HEADERS_CHARS,
    check_exchange_type,
    check_headers_size,
    check_names,
    check_properties,
)
from celery_outbox.task_rules import TaskRules, _check_storable, check_call
from celery_outbox.workers import VERSION_HEADER

OWN_PREFIXES = ("celery.", "celery_outbox.")
DELIVERY_MODES: Mapping[Any, int] = MappingProxyType({"persistent": 2, "transient": 1, 1: 1, 2: 2})
# What kombu's Producer.publish takes as arguments rather than message properties.
log = logging.getLogger(__name__)
_PUBLISH_ARGS = frozenset({"exchange", "routing_key", "serializer", "compression", "retry", "retry_policy",
                           "delivery_mode", "declare", "headers", "timeout", "confirm_timeout", "mandatory",
                           "immediate", "content_type", "content_encoding"})


# Canvas containers an embedded chain may name; their members are checked one by one.
CANVAS_TASKS = frozenset({"celery.group", "celery.chain"})


class Writer(Protocol):
    """Where a captured task message goes: a row in the caller's open transaction."""

    def write(self, values: dict[str, Any]) -> None: ...

    def holds(self, message_id: uuid.UUID) -> bool:
        """True when an outbox row (this transaction's or a committed one) already has ``message_id``."""
        ...


def holds_query(tables: Tables, message_id: uuid.UUID) -> sa.Select[Any]:
    """``SELECT 1`` when an outbox row has ``message_id``: the reused-id check of every SQLAlchemy writer."""
    return sa.select(sa.literal(1)).where(tables.table(tables.outbox).c.message_id == message_id).limit(1)


def _reused_id(values: Mapping[str, Any]) -> ValidationError:
    return ValidationError(f"task {values['type']!r} has task_id {str(values['message_id'])!r}, which an outbox row "
                           "already holds (a task id is the message id: use a new one); nothing was written")


class SessionWriter:
    """Inserts the row on the SQLAlchemy session's connection: it commits or rolls back with the caller's
    data (a savepoint rolled back takes it with it).

    A Core ``INSERT`` at ``delay()``, not an ORM object flushed at commit: the unit of work, the instance
    state and the ``RETURNING seq`` cost more than the whole capture (bench/enqueue_cpu.py), and the row
    is in the transaction when ``delay()`` returns, so the reused-id check is one indexed lookup with no
    bookkeeping of the session's pending objects. On the connection, not ``session.execute``: no
    autoflush of the caller's pending objects (they are flushed when the caller says so)."""

    def __init__(self, session: Session, tables: Tables, *, insert: sa.Insert | None = None) -> None:
        self.session = session
        self.tables = tables
        self.insert = insert if insert is not None else sa.insert(tables.table(tables.outbox))

    def _connection(self) -> sa.Connection:
        return self.session.connection(bind_arguments={"mapper": self.tables.outbox})

    def write(self, values: dict[str, Any]) -> None:
        try:
            self._connection().execute(self.insert, values)
        except sa_exc.IntegrityError:  # a chosen task id another transaction wrote between the check and now
            raise _reused_id(values) from None
        except sa_exc.DBAPIError as e:
            raise DatabaseError(f"writing the outbox row of task {values['type']!r} ({values['message_id']}) "
                                f"failed: {e.orig.__class__.__name__}: {e.orig}") from e

    def write_unique(self, values: dict[str, Any], key: str, on_conflict: dedup.OnConflict) -> dedup.Deduplicated:
        return dedup.write_unique(self.session, values, key=key, on_conflict=on_conflict, tables=self.tables)

    def holds(self, message_id: uuid.UUID) -> bool:
        return self._connection().execute(holds_query(self.tables, message_id)).first() is not None


class OwnTransactionWriter:
    """No transaction is open (a script, a shell, code after the commit): the row commits at once in a
    short transaction of its own on the outbox's engine. Durable (the relay sends it after a crash or a
    broker outage), never atomic with what the caller wrote before (docs/tasks.md, "Transactional enqueue")."""

    def __init__(self, outbox: Any, *, insert: sa.Insert | None = None) -> None:
        self.outbox = outbox
        self.insert = insert if insert is not None else sa.insert(outbox.tables.table(outbox.tables.outbox))

    def write(self, values: dict[str, Any]) -> None:
        self._commit(values, lambda session: session.connection().execute(self.insert, values))

    def write_unique(self, values: dict[str, Any], key: str, on_conflict: dedup.OnConflict) -> dedup.Deduplicated:
        done: list[dedup.Deduplicated] = []
        self._commit(values, lambda session: done.append(dedup.write_unique(
            session, values, key=key, on_conflict=on_conflict, tables=self.outbox.tables)))
        return done[0]

    def _commit(self, values: dict[str, Any], write: Callable[[Session], object]) -> None:
        name = values["type"]
        try:
            with self.outbox.sessions()() as session, session.begin():
                write(session)
        except sa_exc.IntegrityError:  # a chosen task id another process wrote between the check and the insert
            raise _reused_id(values) from None
        except sa_exc.SQLAlchemyError as e:
            raise DatabaseError(f"writing the outbox row of task {name!r} ({values['message_id']}) in a transaction "
                                f"of its own failed: {e.__class__.__name__}; nothing was written") from e

    def holds(self, message_id: uuid.UUID) -> bool:
        try:
            with self.outbox.sessions()() as session:
                return session.connection().execute(holds_query(self.outbox.tables, message_id)).first() is not None
        except sa_exc.SQLAlchemyError as e:
            raise DatabaseError(f"checking task id {message_id} against the outbox failed: "
                                f"{e.__class__.__name__}") from e


def interceptor_of(app: Any) -> Interceptor | None:
    """The capture an ``Outbox`` installed on Celery app ``app`` (``install``), or None."""
    current = app.amqp.__dict__.get("send_task_message")
    return current if isinstance(current, Interceptor) else None


@contextmanager
def publishing_directly(app: Any) -> Iterator[None]:
    """Inside this block every task message ``app`` sends goes straight to the broker (replays, tooling);
    another app's Outbox still captures its own."""
    interceptor = interceptor_of(app)
    if interceptor is None:  # no Outbox on this app: it publishes directly anyway
        yield
        return
    with interceptor.publishing_directly():
        yield


class _Recorder:
    """A stand-in producer: records the one publish Celery's sender makes, publishes nothing."""

    def __init__(self, real: Any) -> None:
        # Never ``real.channel`` (nor ``real.connection``, which falls back to it): on a kombu Producer that
        # property opens the broker connection, and enqueueing must work with the broker down (the relay
        # publishes later; tests/chaos/test_failure_matrix.py::test_broker_down_backlog_drains_nothing_dead_lettered).
        # The pooled producer's Connection object, not connected, is all Celery's sender may read.
        self.connection = getattr(real, "__connection__", None)
        self.channel = None
        self.call: tuple[Any, dict[str, Any]] | None = None

    def publish(self, body: Any, **kwargs: Any) -> None:
        self.call = (body, kwargs)

    def revive(self, *args: Any, **kwargs: Any) -> None:
        pass


class CaptureProducer:
    """What ``app.send_task`` is given as its producer (``SendTask``) while a send may be captured: the
    capture never talks to the broker, so no producer is taken from the pool for it (nor a connection),
    and a send the capture lets through takes one then (``Interceptor.publish``). ``connection`` is the
    app's broker connection object, never connected here: Celery's sender reads it to wrap broker errors
    and for its retry policy, as it reads a pooled producer's."""

    channel = None

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.__connection__ = connection


class Interceptor:
    """``app.amqp.send_task_message`` of one ``Outbox``'s app (``install``), and the capture's state, all of
    it this outbox's own: the sessions bound by ``Outbox.transaction`` (a context variable: each thread and
    asyncio task sees its own), ``publishing_directly``, the dedup record of ``Outbox.enqueue``, and whether
    this process runs ``celery beat``. Two Outboxes (two apps) in one process share none of it."""

    def __init__(self, outbox: Any, amqp: Any, send_task: SendTask) -> None:
        self.outbox = outbox
        self.amqp = amqp
        self.send_task = send_task
        self._original: Callable[..., Any] | None = None
        self._insert: tuple[Tables, sa.Insert] | None = None
        # The writers bound by ``Outbox.transaction``, innermost last.
        self.bound: ContextVar[tuple[Writer, ...]] = ContextVar("celery_outbox_bound", default=())
        self.direct: ContextVar[bool] = ContextVar("celery_outbox_direct", default=False)
        # What the writes with a dedup key did, while ``recording_dedup`` runs (``Outbox.enqueue`` reads it).
        self.deduped: ContextVar[list[dedup.Deduplicated] | None] = ContextVar("celery_outbox_deduped", default=None)
        self.in_beat = False  # set by ``beat_init`` in a ``celery beat`` process (``on_beat_init``)
        self.trace_headers_dropped = tracing.DroppedTraceHeaders(where="the outbox's task capture")

    def on_beat_init(self, sender: Any = None, **kwargs: Any) -> None:
        """This process runs ``celery beat``: its ticks of outbox periodic tasks are rows (celery/beat.py)."""
        self.in_beat = True

    @contextmanager
    def bind(self, writer: Writer) -> Iterator[None]:
        """Inside this block this outbox's captured tasks go to ``writer`` (``Outbox.transaction``)."""
        token = self.bound.set((*self.bound.get(), writer))
        try:
            yield
        finally:
            self.bound.reset(token)

    @contextmanager
    def publishing_directly(self) -> Iterator[None]:
        """Inside this block every task message of this outbox's app goes straight to the broker."""
        token = self.direct.set(True)
        try:
            yield
        finally:
            self.direct.reset(token)

    @contextmanager
    def recording_dedup(self) -> Iterator[list[dedup.Deduplicated]]:
        """Collect what each write with a dedup key did inside this block."""
        found: list[dedup.Deduplicated] = []
        token = self.deduped.set(found)
        try:
            yield found
        finally:
            self.deduped.reset(token)

    def bound_writer(self) -> Writer | None:
        """The innermost writer bound by ``Outbox.transaction``, else an ambient transaction's, else None."""
        bound = self.bound.get()
        return bound[-1] if bound else self.outbox.ambient_writer()

    def insert_statement(self) -> sa.Insert:
        """The one ``INSERT`` of this outbox's table, built once: a new statement per ``delay()`` costs its
        construction and its cache key each time (bench/enqueue_cpu.py)."""
        tables = self.outbox.tables
        if self._insert is None or self._insert[0] is not tables:
            self._insert = (tables, sa.insert(tables.table(tables.outbox)))
        return self._insert[1]

    def session_writer(self, session: Session) -> SessionWriter:
        """A writer of this outbox's rows on ``session`` (``Outbox.transaction``)."""
        return SessionWriter(session, self.outbox.tables, insert=self.insert_statement())

    def publish(self, producer: Any, name: str, message: Any, **options: Any) -> Any:
        """Celery's own sender, as plain Celery runs it: with a pooled producer when ``app.send_task`` was
        given the capture's stand-in (``CaptureProducer``), taken from the pool as Celery takes it."""
        if not isinstance(producer, CaptureProducer):
            return self.original(producer, name, message, **options)
        with self.outbox.app.producer_or_acquire(None) as pooled, pooled.connection._reraise_as_library_errors():
            return self.original(pooled, name, message, **options)

    @property
    def original(self) -> Callable[..., Any]:
        # Celery's own sender, built on first use (never at install: it snapshots the app's queues)
        if self._original is None:
            self._original = self.amqp._create_task_sender()
        return self._original

    def __call__(self, producer: Any, name: str, message: Any, **options: Any) -> Any:
        self.outbox.require_settings()  # settings refused at build (DjangoOutbox): nothing is sent or written
        headers = message[0]
        if self.in_beat and not self.direct.get():
            tick = beat.tick_of({**headers, **(options.get("headers") or {})}, self.outbox.clock.now_ms())
            if tick is not None:
                return self.write_tick(producer, name, message, options, tick)
        if not self.captures(name, headers):
            return self.publish(producer, name, message, **options)
        writer = self.bound_writer()
        if writer is None:
            mode = self.outbox.settings.enqueue_outside_transaction
            if mode == "publish" or self.in_beat or self.outbox.app.current_worker_task is not None:
                return self.publish(producer, name, message, **options)
            if mode == "raise":
                raise TransactionRequiredError(
                    f"task {name!r} was sent outside a transaction: wrap the work in `with outbox.transaction("
                    "session):` (or Django's transaction.atomic()), use outbox.enqueue(session, signature), or set "
                    "OUTBOX_ENQUEUE_OUTSIDE_TRANSACTION=own_transaction (a row committed at once on its own) or "
                    "publish (sent directly: lost if the process dies); nothing was sent")
            writer = OwnTransactionWriter(self.outbox, insert=self.insert_statement())
        options, key = self.dedup_options(name, options)
        if key is not None:
            dedup.check_one_task(message[0], message[2], task=name)
        values = self.row_values(producer, name, message, options)
        if self.send_task.chosen.get() and writer.holds(values["message_id"]):
            raise _reused_id(values)
        if key is None:
            writer.write(values)
            return None
        if not hasattr(writer, "write_unique"):
            raise ConfigError(f"task {name!r} has a dedup key, which this transaction's writer "
                              f"({type(writer).__name__}) cannot keep unique; nothing was written")
        values["headers"][dedup.KEY_HEADER] = key[0]
        done = writer.write_unique(values, key[0], key[1])
        recorded = self.deduped.get()
        if recorded is not None:
            recorded.append(done)
        return None

    def write_tick(self, producer: Any, name: str, message: Any, options: dict[str, Any], tick: beat.Tick) -> None:
        """A beat tick of an outbox periodic task (celery/beat.py): its row, with the tick's own task id, in a
        transaction of its own; a tick already written (a restarted beat firing it again) writes nothing."""
        task_headers, properties, body, sent_event = message
        drop = (beat.BEAT_HEADER, beat.BEAT_EVERY_HEADER)
        old_id = task_headers.get("id")
        task_headers = {k: v for k, v in task_headers.items() if k not in drop}
        task_headers["id"] = str(tick.task_id)
        properties = dict(properties)
        if properties.get("correlation_id") == old_id:
            properties["correlation_id"] = str(tick.task_id)
        options = {**options, "headers": {k: v for k, v in (options.get("headers") or {}).items() if k not in drop}}
        values = self.row_values(producer, name, (task_headers, properties, body, sent_event), options)
        values["headers"][beat.TICK_HEADER] = tick.key
        writer = OwnTransactionWriter(self.outbox, insert=self.insert_statement())
        if writer.holds(values["message_id"]):
            log.info("beat tick %s already in the outbox (task %s): not written again", tick.key, tick.task_id)
            return None
        try:
            writer.write(values)
        except ValidationError:  # written by another beat between the check and the insert
            log.info("beat tick %s written concurrently (task %s): not written again", tick.key, tick.task_id)
            return None
        log.info("beat tick %s written to the outbox as task %s", tick.key, tick.task_id)
        return None

    def dedup_options(self, name: str, options: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, Any] | None]:
        """``options`` without the dedup headers (they never reach the message), and the checked key and
        mode when the caller gave a key (celery_outbox/dedup.py)."""
        headers = options.get("headers")
        if not isinstance(headers, Mapping) or not ({dedup.KEY_HEADER, dedup.ON_CONFLICT_HEADER} & headers.keys()):
            return options, None
        rest = {k: v for k, v in headers.items() if k not in (dedup.KEY_HEADER, dedup.ON_CONFLICT_HEADER)}
        if dedup.KEY_HEADER not in headers:
            raise ValidationError(f"task {name!r}: {dedup.ON_CONFLICT_HEADER} without {dedup.KEY_HEADER}; "
                                  "nothing was written")
        key = dedup.check(headers[dedup.KEY_HEADER], headers.get(dedup.ON_CONFLICT_HEADER), task=name)
        return {**options, "headers": rest}, key

    def captures(self, name: str, headers: Mapping[str, Any]) -> bool:
        if self.direct.get() or name.startswith(OWN_PREFIXES) or name in self.outbox.settings.enqueue_exclude:
            return False
        if is_consumer_task(self.outbox, name):
            return False
        parent = self.outbox.app.current_worker_task
        return not (parent is not None and headers.get("id") == getattr(parent.request, "id", None))

    def row_values(self, producer: Any, name: str, message: Any, options: dict[str, Any]) -> dict[str, Any]:
        """The outbox row of this task message, or an error saying why it cannot be carried."""
        task_headers, _properties, body, _sent_event = message
        embed = body[2] if isinstance(body, (tuple, list)) and len(body) == 3 else None
        if isinstance(embed, Mapping) and embed.get("chord"):
            raise ValidationError(
                f"task {name!r} is part of a chord, which cannot go through the outbox: the chord's counter lives in "
                "the result backend and would exist before your transaction commits. Enqueue the header as a group "
                f"and start the callback from a task, or list {name!r} in OUTBOX_ENQUEUE_EXCLUDE; nothing was written")
        self._check_known(name)
        # Celery's sender merges ``apply_async(headers=...)`` into the message headers: check them merged.
        extra = options.get("headers")
        merged = {**task_headers, **extra} if extra else task_headers  # check_call copies, never mutates
        try:  # the one rule table the worker's gate applies too (celery_outbox/task_rules.py)
            call = check_call(merged, body, rules=self.rules(name))
        except MalformedMessageError as e:
            raise ValidationError(f"task {name[:200]!r}: {e}; nothing was written") from None
        if call.dropped_trace_headers:
            self.trace_headers_dropped.note(call.dropped_trace_headers, task=name)
        message_id = uuid.UUID(call.task_id)
        properties = dict(_properties)
        if properties.get("correlation_id") == task_headers.get("id"):
            properties["correlation_id"] = call.task_id
        task_headers = call.headers
        what = f"task {name!r} arguments (the outbox carries JSON only: str, int, float, bool, None, list, dict)"
        # Refused here, before Celery's sender and its before_task_publish receivers see it.
        body_json = encode_json(list(body) if isinstance(body, tuple) else body, what=what)
        recorder = _Recorder(producer)
        options = {k: v for k, v in options.items() if k not in ("event_dispatcher", "headers")}
        self.original(recorder, name, (task_headers, properties, body, None), **options)
        if recorder.call is None:  # pragma: no cover - Celery's sender always publishes once
            raise ConfigError(f"Celery did not build a message for task {name!r}")
        sent_body, publish = recorder.call
        serializer = publish.get("serializer") or "json"
        if serializer != "json" or publish.get("compression"):
            raise SerializationError(f"task {name!r} asks for serializer={serializer!r} compression="
                                     f"{publish.get('compression')!r}: the outbox carries plain JSON only")
        exchange = publish.get("exchange")
        exchange_name = exchange.name if isinstance(exchange, Exchange) else (exchange or "")
        queue = next((q for q in publish.get("declare") or () if isinstance(q, Queue)), None)
        properties = {k: v for k, v in publish.items() if k not in _PUBLISH_ARGS and _is_json(v)}
        sent_headers = dict(publish.get("headers") or task_headers)
        task = self.outbox.app.tasks.get(name)
        if not getattr(task, "outbox_task_key", None):
            sent_headers[RECEIPT_HEADER] = 1  # a plain task: its worker records a receipt (celery/receipts.py)
        row_headers: dict[str, Any] = {
            "outbox_kind": TASK_KIND,
            # the caller's trace context (a no-op without OpenTelemetry): the relay and worker continue it
            "task_headers": tracing.traced_headers(sent_headers),
            "properties": properties,
            "exchange": str(exchange_name),
            "routing_key": str(publish.get("routing_key") or ""),
            "queue": None if queue is None else queue_spec(queue).to_dict(),
            "priority": properties.get("priority"),
            "delivery_mode": DELIVERY_MODES.get(publish.get("delivery_mode") or 2, 2),
        }
        self._check_route(name, row_headers)
        version = getattr(task, "outbox_task_version", None)
        if isinstance(version, int) and not isinstance(version, bool) and version > 0:
            row_headers[VERSION_HEADER] = version  # the relay holds it for a worker that runs it (workers.py)
        sent = list(sent_body)
        if sent_body is not body or signals.before_task_publish.receivers:  # a receiver may have changed it
            body_json = encode_json(sent, what=what)
        headers_json = encode_json(row_headers, what=f"task {name!r} message headers (JSON only)")
        if len(headers_json) > MAX_HEADERS_CHARS:  # the row's ASCII JSON bounds the UTF-8 bytes of the message's headers
            check_headers_size(row_headers["task_headers"], what=f"task {name!r}")
        # The row as JSON (``encode_json({"headers": ..., "payload": {"body": ...}})``, keys sorted), without
        # encoding it again: what the size limit measures.
        check_size(f'{{"headers":{headers_json},"payload":{{"body":{body_json}}}}}',
                   limit=self.outbox.settings.max_message_bytes, what=f"task {name!r} message")
        # Both are plain JSON now (checked strictly above); the writer stores them as they are, in this call.
        payload = {"body": sent}
        now = self.outbox.clock.now_ms()
        due = self.held_until(row_headers["task_headers"], now)
        if due is not None:  # held in the outbox until due, published then without an eta (docs/scheduled.md)
            row_headers["task_headers"] = {**row_headers["task_headers"], "eta": None}
            row_headers["held_until_ms"] = due
        return {"message_id": message_id, "type": name, "payload": payload, "headers": row_headers,
                "created_at_ms": now, "next_attempt_at_ms": now if due is None else due, "attempts": 0}

    @staticmethod
    def _check_route(name: str, row_headers: Mapping[str, Any]) -> None:
        """The route and properties the relay will send (``task_route``), refused here rather than stored: text no
        database column stores fails the caller's commit, and what no broker client encodes fails every relay
        batch the row is in."""
        try:
            _check_storable({k: row_headers[k] for k in ("properties", "exchange", "routing_key", "queue")},
                            what="message properties")
            queue = row_headers["queue"]
            spec = None if queue is None else QueueSpec.from_dict(queue)
            check_names([("exchange", row_headers["exchange"]), ("routing key", row_headers["routing_key"])] + (
                [] if spec is None else [("queue name", spec.name), ("queue exchange", spec.exchange),
                                         ("queue routing key", spec.routing_key)]))
            check_properties(row_headers["properties"])
            if spec is not None:
                check_exchange_type(spec.exchange_type)
        except MalformedMessageError as e:
            raise ValidationError(f"task {name[:200]!r}: {e}; nothing was written") from None

    def held_until(self, task_headers: Mapping[str, Any], now_ms: int) -> int | None:
        """The eta in ms when it is more than ``enqueue_hold_eta_after_ms`` ahead of ``now_ms`` (the row is then
        held until it), else None (the message keeps its eta, as Celery sent it).

        Celery wrote ``eta`` as ISO 8601 (``countdown`` already turned into it at send time); a naive eta
        is UTC, as Celery's worker reads it (``maybe_make_aware``)."""
        raw = task_headers.get("eta")
        if not isinstance(raw, str):
            return None
        try:
            eta = datetime.fromisoformat(raw)
        except ValueError:
            raise ValidationError(f"task {task_headers.get('task')!r} has an eta {raw[:60]!r} that is not an ISO "
                                  "8601 time; nothing was written") from None
        eta = maybe_make_aware(eta)
        eta_ms = int(eta.timestamp() * 1000)
        return eta_ms if eta_ms > now_ms + self.outbox.settings.enqueue_hold_eta_after_ms else None

    def rules(self, name: str) -> TaskRules:
        """The rule table's view from this app: which callbacks it carries, the task's signature."""
        task = self.outbox.app.tasks.get(name)
        return TaskRules(max_depth=self.outbox.settings.max_json_depth, captured=True,
                         known=lambda callback: carried(self.outbox, callback),
                         arity=getattr(task, "__header__", None) if task is not None and task.typing else None)

    def _check_known(self, name: str) -> None:
        app = self.outbox.app
        if name in app.tasks or app.amqp.router.lookup_route(name) is not None:
            return
        raise ValidationError(
            f"task {name!r} is neither registered on this Celery app nor routed by its task_routes: the relay would "
            "publish a message no worker of this app runs. Register the task, route it in task_routes, or list it "
            "in OUTBOX_ENQUEUE_EXCLUDE to send it directly; nothing was written")


def carried(outbox: Any, name: str) -> bool:
    """True when task ``name`` is one the outbox carries (an embedded callback may name it): this app
    registers or routes it, and it is neither a library task, a consumer's task nor Celery's own
    (except the canvas containers, whose members are checked themselves)."""
    if name in CANVAS_TASKS:
        return True
    if name.startswith(OWN_PREFIXES) or is_consumer_task(outbox, name):
        return False
    app = outbox.app
    return name in app.tasks or app.amqp.router.lookup_route(name) is not None


def is_consumer_task(outbox: Any, name: str) -> bool:
    """True when ``name`` is a consumer's task. Every one starts with ``task_name("")``: any other task
    (each ``delay()``) is answered without building the set of consumers' task names."""
    return name.startswith(task_name("")) and name in own_task_names(outbox)


def own_task_names(outbox: Any) -> frozenset[str]:
    return frozenset(task_name(c) for c in outbox.known_consumers())


def queue_spec(queue: Queue) -> QueueSpec:
    exchange = queue.exchange
    raw_arguments = getattr(queue, "queue_arguments", None)
    arguments = dict(raw_arguments) if raw_arguments else None
    return QueueSpec(name=queue.name, exchange=(exchange.name if exchange is not None else "") or "",
                     exchange_type=(exchange.type if exchange is not None else "direct") or "direct",
                     routing_key=queue.routing_key or "", durable=bool(queue.durable),
                     auto_delete=bool(queue.auto_delete), exclusive=bool(queue.exclusive),
                     arguments=arguments if arguments is None or _is_json(arguments) else None,
                     max_priority=getattr(queue, "max_priority", None))


_ALWAYS_JSON = frozenset({str, int, bool, type(None)})  # exactly these types: strict JSON whatever the value


def _is_json(value: Any) -> bool:
    if type(value) in _ALWAYS_JSON:  # most message properties (ids, priority): no encoder run
        return True
    try:
        encode_json(value)
    except SerializationError:
        return False
    return True


class SendTask:
    """``app.send_task`` of an Outbox's app: notes whether its caller chose the task id (only those can be
    reused: ``chosen``), and gives Celery the capture's stand-in producer (``CaptureProducer``) instead of
    letting it take one from the pool for a message the capture may keep.

    ``Task.apply_async`` passes ``task_id`` by keyword, None unless the caller (or a canvas Celery
    froze) set one; ``send_task`` then makes a fresh uuid4. The stand-in is given only when the caller
    passed no producer or connection and the result backend's ``on_task_call`` (which Celery runs with the
    producer before the send) does not use the producer: Celery's base backend and Redis's; the RPC backend
    declares its reply queue on it, so with it Celery takes a pooled producer as before."""

    _TASK_ID_POSITION = 5  # send_task(name, args, kwargs, countdown, eta, task_id, ...)
    _PRODUCER_ARGS = ("producer", "connection", "publisher")

    def __init__(self, app: Any, send_task: Callable[..., Any]) -> None:
        self.app = app
        self.send_task = send_task
        # True while ``app.send_task`` runs with a task id its caller passed.
        self.chosen: ContextVar[bool] = ContextVar("celery_outbox_chosen_id", default=False)
        self._producer: CaptureProducer | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        chosen = kwargs.get("task_id") if "task_id" in kwargs else (
            args[self._TASK_ID_POSITION] if len(args) > self._TASK_ID_POSITION else None)
        if len(args) <= self._TASK_ID_POSITION + 1 and not any(kwargs.get(k) for k in self._PRODUCER_ARGS) \
                and self._backend_producer_free():
            kwargs["producer"] = self.capture_producer()
        token = self.chosen.set(bool(chosen))
        try:
            return self.send_task(*args, **kwargs)
        finally:
            self.chosen.reset(token)

    def _backend_producer_free(self) -> bool:
        try:
            backend = self.app.backend
        except Exception:  # a result backend that cannot be built fails where it failed before: in Celery's send
            return False
        return _producer_free(backend)

    def capture_producer(self) -> CaptureProducer:
        if self._producer is None:  # the app's broker connection object, never connected by the capture
            self._producer = CaptureProducer(self.app.connection_for_write())
        return self._producer


def _producer_free(backend: Any) -> bool:
    """True when ``backend.on_task_call`` does not use the producer it is given (``SendTask``).

    Celery's Redis backend is looked up only once something imported it (a Redis result backend has): its
    module imports the redis client, which a project on RabbitMQ need not have installed."""
    call = getattr(type(backend), "on_task_call", None)
    if call is Backend.on_task_call:
        return True
    redis_backends = sys.modules.get("celery.backends.redis")
    return redis_backends is not None and call is redis_backends.RedisBackend.on_task_call


def install(outbox: Any) -> Interceptor:
    """Wrap ``outbox.app``'s ``amqp.send_task_message`` (once); a second Outbox on one app is refused."""
    amqp = outbox.app.amqp
    current = amqp.__dict__.get("send_task_message")
    if isinstance(current, Interceptor):
        if current.outbox is outbox:
            return current
        raise ConfigError("this Celery app already has an Outbox: build one Outbox per Celery app")
    app = outbox.app
    send_task = app.__dict__.get("send_task")
    if not isinstance(send_task, SendTask):
        send_task = app.send_task = SendTask(app, app.send_task)  # an instance attribute over Celery's method
    interceptor = Interceptor(outbox, amqp, send_task)
    amqp.send_task_message = interceptor  # an instance attribute over Celery's cached property
    # Held weakly by the signal: connected as long as this outbox's app keeps its interceptor.
    signals.beat_init.connect(interceptor.on_beat_init)
    return interceptor
