"""The Kombu publisher: the only module of ``relay`` that imports kombu.

Durability per batch, not per message (docs/design.md, "Measured limits"): on RabbitMQ the channel is put in
confirm mode once and a whole batch is published before waiting for its acks (or, with
``confirm_mode="tx"``, published inside one channel transaction); messages are persistent and
``mandatory`` so an unroutable one comes back as a ``basic.return`` and is reported as rejected.
Exchange, consumer queues and bindings are declared on every new connection before the first
publish (Redis silently drops messages for an exchange with no bound queue); a task enqueued through
the outbox goes to its own exchange and routing key, its queue declared (as the Celery app declares
it) before the first publish to it on each connection. There is no infinite
retry anywhere: a connection attempt is retried ``connect_retries`` times, then the batch fails
with ``BrokerUnavailableError`` and the relay's circuit breaker takes over; the next batch opens a
fresh connection.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from types import TracebackType
from typing import Any

import amqp
from kombu import Connection, Exchange, Producer, Queue
from kombu.exceptions import KombuError

from celery_outbox.celery.amqp_wire import event_message, task_message
from celery_outbox.celery.config import celery_config, require_broker_client, sentinel_options
from celery_outbox.config.declare import broker_kind
from celery_outbox.errors import BrokerUnavailableError, ConfigError, ValidationError
from celery_outbox.messages import QueueSpec, TaskMessage
from celery_outbox.relay.publisher import PublishReport
from celery_outbox.settings import Settings
from celery_outbox.task_route import check_headers_size, headers_may_be_large

log = logging.getLogger("relay.kombu")

CONFIRM_MODES = ("confirm", "tx", "none")
WRITE_CHUNK = 256 * 1024  # bytes of frames collected before one socket write (``_coalesced_writes``)
VIRTUAL_EXCHANGE_TYPES = ("direct", "topic", "fanout")  # what kombu's virtual transports (Redis) implement
NACK_PAUSE_S = 0.2  # before nacked messages are sent again (``_await``)


class KombuPublisher:
    """Publishes ``TaskMessage`` batches to the direct exchange of the settings' namespace."""

    def __init__(self, *, broker_url: str, settings: Settings | None = None, exchange_name: str | None = None,
                 queue_names: Sequence[str] | None = None, confirm_mode: str | None = None,
                 publish_timeout_s: float | None = None, connect_retries: int = 1,
                 transport_options: dict[str, Any] | None = None, consumers: Sequence[str] | None = None) -> None:
        if settings is None and (exchange_name is None or queue_names is None):
            raise ConfigError("KombuPublisher needs settings, or exchange_name and queue_names")
        mode = confirm_mode or (settings.relay_confirm_mode if settings is not None else "confirm")
        if mode not in CONFIRM_MODES:
            raise ConfigError(f"confirm_mode must be one of {', '.join(CONFIRM_MODES)}, got {mode!r}")
        require_broker_client(broker_url)
        self.broker_url = broker_url
        self.confirm_mode = mode
        self.is_rabbitmq = broker_kind(broker_url) == "rabbitmq"
        self.timeout_s = publish_timeout_s or (settings.relay_publish_timeout_s if settings is not None else 10.0)
        self.connect_retries = connect_retries
        if settings is not None:
            # The very Queue objects Celery workers declare, so the declarations can never disagree.
            exchange_name = settings.exchange_name
            names = tuple(consumers) if consumers is not None else settings.consumers
            consumer_queues = {settings.queue_name(c) for c in names}
            self.queues: list[Queue] = [q for q in celery_config(settings, broker_url, consumers=names)["task_queues"]
                                        if q.name in consumer_queues]
            self.exchange = Exchange(exchange_name, type="direct", durable=True)
        else:
            assert exchange_name is not None and queue_names is not None
            self.exchange = Exchange(exchange_name, type="direct", durable=True)
            self.queues = [Queue(q, self.exchange, routing_key=q, durable=True) for q in queue_names]
        options: dict[str, Any] = {}
        if broker_kind(broker_url) == "redis":  # sentinel:// included
            options.update(socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s)
        if settings is not None:  # a sentinel:// broker's master name (config.sentinel_options)
            options.update(sentinel_options(settings, broker_url))
        options.update(transport_options or {})
        options["confirm_publish"] = False  # we confirm per batch ourselves, never per message
        self._transport_options = options
        self._conn: Any = None
        self._channel: Any = None
        self._producer: Any = None
        self._task_producer: Any = None
        self._lean: Any = None  # py-amqp's channel when messages skip kombu's Producer (``_publish_one``)
        self._declared: set[str] = set()  # task queues declared on this connection
        self._declaring: Any = None  # RabbitMQ: the channel task queues are declared on (``_declare_task_queue``)
        self._exchanges: dict[str, bool] = {}  # exchanges only named by tasks: exist? (asked once per connection)
        self._refused: dict[int, str] = {}  # this batch's messages not sent: the broker would close the channel
        self._next_tag = 0
        self._outstanding: dict[int, int] = {}
        self._nacked: set[int] = set()
        self._returned: dict[str, str] = {}
        self.connections_opened = 0
        self.nacks_resent = 0  # messages sent again after a nack (``_await``)

    # -- connection ------------------------------------------------------------------------------
    def _errors(self) -> tuple[type[BaseException], ...]:
        conn = self._conn or Connection(self.broker_url)
        return (*conn.connection_errors, *conn.channel_errors, OSError, KombuError)

    def _ensure(self) -> Any:
        if self._producer is not None:
            return self._producer
        conn = Connection(self.broker_url, connect_timeout=self.timeout_s,
                          transport_options=self._transport_options)
        self._conn = conn
        # A cluster's failover URL (``amqp://a;amqp://b;amqp://c``): kombu moves to the next node after
        # each failed attempt, and every batch opens a fresh connection starting at the first one, so
        # each node gets its attempt before the batch fails (else two nodes down would hide the third).
        alternates = len(conn.alt) if getattr(conn, "alt", None) else 1
        conn.ensure_connection(max_retries=self.connect_retries + alternates - 1, interval_start=0.2,
                               interval_step=0.5, interval_max=1.0, timeout=self.timeout_s)
        channel = conn.channel()
        self._channel = channel
        for queue in self.queues:
            queue(channel).declare()
        if self.is_rabbitmq and self.confirm_mode == "confirm":
            channel.confirm_select()
            channel.events["basic_ack"].add(self._on_ack)
            channel.events["basic_nack"].add(self._on_nack)
            self._next_tag = 0
        elif self.is_rabbitmq and self.confirm_mode == "tx":
            channel.tx_select()
        self._producer = Producer(channel, exchange=self.exchange, auto_declare=False,
                                  on_return=self._on_return if self.is_rabbitmq else None)
        # Tasks enqueued through the outbox name their own exchange, "" (the default exchange) included,
        # which a producer bound to the events exchange cannot express (kombu reads "" as "mine").
        self._task_producer = Producer(channel, auto_declare=False,
                                       on_return=self._on_return if self.is_rabbitmq else None)
        self._lean = channel if self.is_rabbitmq and isinstance(channel, amqp.Channel) else None
        self._declared.clear()
        self._exchanges.clear()
        self._quiet_blocked_check()
        self.connections_opened += 1
        return self._producer

    def _declare_task_queue(self, spec: QueueSpec) -> str | None:
        """Declare a task's queue (and its exchange and binding) once per connection, before its first publish.

        Why not, when RabbitMQ refuses the declaration (a task given its own declaration of a queue that exists
        with other arguments): that is the task's own failure, charged to its row, so the declaration is made
        on a channel of its own, which the refusal closes instead of the batch's."""
        if spec.name in self._declared:
            return None
        exchange = Exchange(spec.exchange, type=spec.exchange_type, durable=spec.durable) if spec.exchange else ""
        queue = Queue(spec.name, exchange, routing_key=spec.routing_key or spec.name, durable=spec.durable,
                      auto_delete=spec.auto_delete, exclusive=spec.exclusive, queue_arguments=spec.arguments,
                      max_priority=spec.max_priority)
        if not self.is_rabbitmq:
            if spec.exchange and spec.exchange_type not in VIRTUAL_EXCHANGE_TYPES:
                # kombu's Redis transport raises KeyError for another type, which would read as an outage
                return (f"exchange type {spec.exchange_type!r} of queue {spec.name[:100]!r} is none this broker "
                        f"has ({', '.join(VIRTUAL_EXCHANGE_TYPES)})")
            queue(self._channel).declare()
        else:
            channel = self._declaring if self._declaring is not None else self._conn.channel()
            self._declaring = channel
            try:
                queue(channel).declare()
            except tuple(self._conn.channel_errors) as e:
                self._declaring = None
                with suppress(Exception):
                    channel.close()
                return f"the broker refused to declare queue {spec.name[:100]!r}: {e}"
        self._declared.add(spec.name)
        return None

    def _reset(self) -> None:
        conn, self._conn, self._channel, self._producer = self._conn, None, None, None
        self._declaring = None
        self._task_producer = self._lean = None
        self._declared.clear()
        self._exchanges.clear()
        self._outstanding.clear()
        self._nacked.clear()
        self._returned.clear()
        if conn is not None:
            try:
                conn.release()
            except Exception:  # a dead connection may fail to close; it is dropped either way
                log.debug("closing a broken broker connection failed", exc_info=True)

    # -- confirm callbacks -----------------------------------------------------------------------
    def _settle(self, delivery_tag: int, multiple: bool, *, nack: bool) -> None:
        tags = [t for t in self._outstanding if t <= delivery_tag] if multiple else [delivery_tag]
        for tag in tags:
            index = self._outstanding.pop(tag, None)
            if index is not None and nack:
                self._nacked.add(index)

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(delivery_tag, multiple, nack=False)

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(delivery_tag, multiple, nack=True)

    def _on_return(self, exc: Any, exchange: str, routing_key: str, message: Any) -> None:
        props = getattr(message, "properties", {}) or {}
        cid = props.get("correlation_id")
        if cid is not None:
            self._returned[str(cid)] = f"unroutable (returned by the broker: {exc}) routing_key={routing_key!r}"

    # -- one write per batch (py-amqp only) -------------------------------------------------------
    def _amqp_transport(self) -> Any:
        """py-amqp's transport under our connection, or None (Redis, or a client without ``_write``)."""
        if not self.is_rabbitmq or self._conn is None:
            return None
        transport = getattr(getattr(self._conn, "connection", None), "transport", None)
        return transport if transport is not None and hasattr(transport, "_write") else None

    @contextmanager
    def _coalesced_writes(self) -> Iterator[None]:
        """Collect the frames of a batch and hand them to the socket in a few large writes.

        py-amqp writes every frame with its own ``sendall``, from a buffer it reuses (so each chunk is
        copied here). Frames are flushed every ``WRITE_CHUNK`` bytes and at the end; if publishing
        raises, what was collected is dropped and the error propagates (the batch is then left
        pending, as for any broken publish). After each mid-batch flush the confirms that have
        arrived are read without waiting, so a large batch never leaves the broker blocked on a full
        socket towards us while we block writing to it. Without py-amqp this is a no-op.
        """
        transport = self._amqp_transport()
        if transport is None:
            yield
            return
        original = transport._write
        chunks: list[bytes] = []
        size = 0

        def collect(data: Any) -> None:
            nonlocal size
            chunks.append(bytes(data))
            size += len(data)
            if size >= WRITE_CHUNK:
                flush()
                with suppress(socket.timeout):
                    self._conn.drain_events(timeout=0)

        def flush() -> None:
            nonlocal size
            if chunks:
                data = b"".join(chunks)
                chunks.clear()
                size = 0
                original(data)

        transport._write = collect
        try:
            yield
        finally:
            transport._write = original
        flush()

    def _quiet_blocked_check(self) -> None:
        """Stop py-amqp's per-publish ``drain_events(timeout=0)`` on this connection only.

        py-amqp drains the socket before EVERY publish when the client announced the
        ``connection.blocked`` capability (measured in the publish step: docs/benchmarks.md). The capability
        was already sent to the broker in the handshake, so the broker still tells us when it blocks;
        we read it once per batch (``_send``) and while waiting for confirms, instead of per message.
        The connection gets its own copy of the properties: py-amqp's defaults are shared.
        """
        inner = getattr(self._conn, "connection", None)
        props = getattr(inner, "client_properties", None)
        if inner is None or not isinstance(props, dict):
            return
        caps = dict(props.get("capabilities") or {})
        if caps.get("connection.blocked"):
            caps["connection.blocked"] = False
            inner.client_properties = {**props, "capabilities": caps}

    # -- Publisher -------------------------------------------------------------------------------
    def publish_batch(self, messages: Sequence[TaskMessage]) -> PublishReport:
        return self.send_batch(messages)()

    def send_batch(self, messages: Sequence[TaskMessage]) -> Callable[[], PublishReport]:
        """Write the batch now; the returned call waits for its confirms (``SendsAhead``)."""
        if not messages:
            empty = PublishReport(count=0)
            return lambda: empty
        errors = self._errors()
        try:
            self._send(messages)
        except errors as e:
            self._reset()
            raise BrokerUnavailableError(f"broker unavailable: {e.__class__.__name__}: {e}") from e

        def wait() -> PublishReport:
            try:
                return self._await(messages)
            except errors as e:
                self._reset()
                raise BrokerUnavailableError(f"broker unavailable: {e.__class__.__name__}: {e}") from e

        return wait

    def _send(self, messages: Sequence[TaskMessage]) -> None:
        producer = self._ensure()
        self._nacked.clear()
        self._returned.clear()
        self._outstanding.clear()
        confirm = self.is_rabbitmq and self.confirm_mode == "confirm"
        if self._amqp_transport() is not None:
            with suppress(socket.timeout):
                self._conn.drain_events(timeout=0)  # once per batch: a blocked/closed connection shows here
        self._refused = {}
        for i, m in enumerate(messages):  # declaring is a round trip: never inside the collected writes
            if m.exchange is None:
                continue
            why = self._channel_refusal(m)
            if why is None and m.queue is not None:
                why = self._declare_task_queue(m.queue)
            if why is not None:
                self._refused[i] = why
        with self._coalesced_writes():
            for i, m in enumerate(messages):
                if i not in self._refused:
                    self._publish_one(producer, i, m, confirm=confirm)

    def _channel_refusal(self, m: TaskMessage) -> str | None:
        """Why RabbitMQ would close the channel on this task's publish, or None. A closed channel fails the whole
        batch as an outage, never charged to a row, so a task routed to an exchange nothing declares (a
        ``task_routes`` entry naming no queue), or one whose ``user_id`` is not the user the relay connects as,
        would stop the relay publishing anything. Not sent, it is this message's own failure (``rejected``): an
        attempt charged, dead-lettered at max_attempts (docs/design.md, rule 3: a failure of this message)."""
        if not self.is_rabbitmq:
            return None
        user = m.properties.get("user_id")
        if user is not None and user != (self._conn.userid or "guest"):
            return (f"user_id {str(user)[:60]!r} is not the user the relay connects as: RabbitMQ refuses the "
                    "message for the whole channel")
        if headers_may_be_large(m.headers):  # a row stored before enqueue refused them (task_route.py)
            try:
                check_headers_size(m.headers, what=f"task {m.consumer[:100]!r}")
            except ValidationError as e:
                return f"{str(e).removesuffix('; nothing was written')}: RabbitMQ closes the connection on it"
        name = m.exchange
        if not name or (m.queue is not None and m.queue.exchange == name):
            return None  # the default exchange, or one declared with the task's queue
        if name not in self._exchanges:
            channel = self._conn.channel()  # a passive declare of a missing exchange closes its channel
            try:
                channel.exchange_declare(exchange=name, type="direct", passive=True)
                self._exchanges[name] = True
            except tuple(self._conn.channel_errors):
                self._exchanges[name] = False
            finally:
                with suppress(Exception):
                    channel.close()
        if not self._exchanges[name]:
            return f"unroutable: exchange {name!r} does not exist (no queue of the task declares it)"
        return None

    def _publish_one(self, producer: Any, index: int, m: TaskMessage, *, confirm: bool) -> None:
        if confirm:  # registered before the write: its ack may be read during the batch
            self._next_tag += 1
            self._outstanding[self._next_tag] = index
        lean = self._lean if producer is self._producer else None
        if m.exchange is None:  # an event to one consumer: the namespace's events exchange
            if lean is not None:  # the frames kombu would write, without its Producer (celery/amqp_wire.py)
                lean.basic_publish(event_message(m), exchange=self.exchange.name, routing_key=m.routing_key,
                                   mandatory=True)
                return
            producer.publish(
                m.body, routing_key=m.routing_key, headers=m.headers, content_type="application/json",
                content_encoding="utf-8", delivery_mode=2, mandatory=self.is_rabbitmq, retry=False,
                **m.properties,
            )
            return
        # a task enqueued through the outbox: where Celery would have sent it (queue declared above)
        if lean is not None and (message := task_message(
                m, default_delivery_mode=self._task_producer.exchange.delivery_mode)) is not None:
            lean.basic_publish(message, exchange=m.exchange or self._task_producer.exchange.name,
                               routing_key=m.routing_key, mandatory=True)
            return
        self._task_producer.publish(
            m.body, exchange=m.exchange or None, routing_key=m.routing_key, headers=m.headers,
            content_type="application/json", content_encoding="utf-8", delivery_mode=m.delivery_mode,
            mandatory=self.is_rabbitmq, retry=False, **m.properties,
        )

    def _await(self, messages: Sequence[TaskMessage]) -> PublishReport:
        """Wait for the batch's confirms; re-send what the broker nacked until the publish timeout.

        RabbitMQ nacks a message only when the queue could not take it: a quorum queue whose leader
        was lost answers nacks until a new leader is elected (seconds; tests/cluster/test_node_loss.py
        saw rows dead-lettered by it), a queue process that crashed, a full queue with
        ``x-overflow=reject-publish``. None of these is the message's fault, so the nacked messages are
        sent again (only they: the acked ones are not duplicated) and, still nacked at the deadline, the
        connection is dropped and the batch fails as ``BrokerUnavailableError``: a relay-wide condition
        for the breaker, never an attempt charged to the rows. A message the broker cannot route comes back as a return and is
        the message's own failure (``rejected``).
        """
        if self.is_rabbitmq and self.confirm_mode == "confirm":
            deadline = time.monotonic() + self.timeout_s
            while True:
                while self._outstanding:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(f"no publisher confirm for {len(self._outstanding)} message(s) "
                                           f"within {self.timeout_s}s")
                    self._conn.drain_events(timeout=remaining)
                if not self._nacked:
                    break
                if time.monotonic() + NACK_PAUSE_S >= deadline:
                    # A fresh connection for the next batch: a channel was seen nacking one quorum queue
                    # for 30 s after that queue had a new leader (node-loss run), while new channels
                    # published to it at once.
                    nacked = len(self._nacked)
                    self._reset()
                    raise BrokerUnavailableError(
                        f"broker unavailable: RabbitMQ nacked {nacked} message(s) for {self.timeout_s}s "
                        "(a queue that cannot take messages, e.g. a quorum queue without a leader)")
                again, self._nacked = sorted(self._nacked), set()
                time.sleep(NACK_PAUSE_S)
                self.nacks_resent += len(again)
                for i in again:
                    self._publish_one(self._producer, i, messages[i], confirm=True)
        elif self.is_rabbitmq and self.confirm_mode == "tx":
            self._channel.tx_commit()
        rejected: dict[int, str] = {i: "broker nacked the message" for i in self._nacked}
        rejected.update(self._refused)
        if self._returned:
            for i, m in enumerate(messages):
                why = self._returned.get(str(m.properties.get("correlation_id")))
                if why is not None:
                    rejected[i] = why
        return PublishReport(count=len(messages), rejected=rejected)

    def close(self) -> None:
        self._reset()

    def __enter__(self) -> KombuPublisher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
