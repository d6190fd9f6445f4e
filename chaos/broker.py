"""Brokers a chaos run can take down and bring back.

Redis: a redis-server of our own on a free port, ``--appendonly yes --appendfsync always``, stopped
for real (SIGKILL, so nothing gets a graceful flush) and restarted on the same port and data dir;
whatever it acknowledged must still be there. RabbitMQ: the shared server is never stopped, so the
outage is a loopback TCP proxy we cut (every connection reset, the port refuses) and restore; every
queue and exchange lives under the run's own namespace and is deleted at the end.

Both also provoke the take-window loss (``take_and_lose``): a message published, its outbox row
marked, then gone from the broker without any consumer having recorded it. On Redis that is exactly
the state a worker SIGKILLed between kombu's take (``BRPOP``) and its unacked record leaves: the
message is no longer in the queue list and not in the unacked set, so the broker never redelivers
it. On RabbitMQ a worker killed there loses nothing (the broker requeues what a dead channel left
unacked); the same state arises only when a channel acknowledges a message it never processed (an
auto-ack consumer killed after the delivery, a task acked early), which is what we do.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from relay.embedded import EmbeddedServerError, free_port

SHARED_RABBITMQ_URL = os.environ.get("OUTBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")

# Is this message (by its Celery headers) one to lose? Called with the headers of each candidate.
Wanted = Callable[[Mapping[str, Any]], bool]


@dataclass(frozen=True, kw_only=True)
class TakenMessage:
    """A message ``take_and_lose`` removed from ``queue``: its Celery headers, never processed."""

    queue: str
    headers: Mapping[str, Any]

    @property
    def message_id(self) -> str:
        return _message_id(self.headers)


def _message_id(headers: Mapping[str, Any]) -> str:
    """The outbox message id a message carries (an event's header; a task's own id is its row's message id)."""
    return str(headers.get("outbox_message_id") or headers.get("id"))


def _headers(payload: Any) -> Mapping[str, Any]:
    headers = payload.get("headers") if isinstance(payload, Mapping) else None
    return headers if isinstance(headers, Mapping) else {}


class ChaosBroker(Protocol):
    kind: str

    @property
    def url(self) -> str: ...

    def take_and_lose(self, *, queue: str, wanted: Wanted) -> TakenMessage | None: ...

    def describe_take(self) -> str: ...

    def start(self) -> None: ...

    def outage_begin(self) -> None: ...

    def outage_end(self) -> None: ...

    def close(self, *, namespace: str, queues: list[str]) -> None: ...

    def describe_outage(self) -> str: ...


def redis_binary() -> str:
    for candidate in ("/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if os.access(candidate, os.X_OK):
            return candidate
    from relay.embedded import redis_server_binary

    return redis_server_binary()


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisBroker:
    """A durable redis-server of our own that a run can kill and restart on the same port."""

    kind = "redis"

    def __init__(self, *, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *, timeout_s: float = 15.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir / "redis.log", "ab")  # noqa: SIM115 - handed to the child
        self._proc = subprocess.Popen(
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
             "--appendonly", "yes", "--appendfsync", "always", "--maxmemory-policy", "noeviction",
             "--save", "", "--daemonize", "no"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while not _redis_ping(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise EmbeddedServerError(f"chaos redis-server did not start; see {self.data_dir / 'redis.log'}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no shutdown save; only the fsynced append-only file survives."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(timeout=10)
        self._proc = None

    def outage_begin(self) -> None:
        self.kill()

    def outage_end(self) -> None:
        self.start()
        self.restarts += 1

    def describe_outage(self) -> str:
        return "own redis-server SIGKILLed and restarted on the same port (appendfsync always)"

    def describe_take(self) -> str:
        return "LREM from the queue list before any BRPOP: the state of a worker SIGKILLed between take and unacked record"

    def take_and_lose(self, *, queue: str, wanted: Wanted) -> TakenMessage | None:
        """Remove one ``wanted`` message from ``queue``'s lists (every priority level) with ``LREM``.

        ``LREM`` of the exact element is atomic: it returns 1 only if no worker's ``BRPOP`` took that
        message first, so what is returned was never seen by a worker. Only a message whose id appears
        once in the queue and not in kombu's unacked hash is taken: a second copy (a relay killed
        before its mark publishes a row twice) would bring it back without the reconciler. None: no
        such message now.
        """
        import json

        import redis

        def headers_of(raw: str, *, in_unacked: bool = False) -> Mapping[str, Any]:
            try:
                payload = json.loads(raw)
            except ValueError:
                return {}
            if in_unacked:  # [message, exchange, routing key]
                payload = payload[0] if isinstance(payload, list) and payload else {}
            return _headers(payload)

        client = redis.Redis.from_url(self.url, socket_timeout=5, decode_responses=True)
        try:
            keys = [queue, *(f"{queue}\x06\x16{p}" for p in (3, 6, 9))]  # kombu's priority lists
            listed = [(key, str(raw)) for key in keys for raw in client.lrange(key, 0, -1)]
            parsed = [(key, raw, headers_of(raw)) for key, raw in listed]
            copies = Counter(_message_id(h) for _, _, h in parsed)
            copies.update(_message_id(headers_of(str(raw), in_unacked=True))
                          for raw in client.hvals("unacked"))
            for key, raw, headers in parsed:
                if copies[_message_id(headers)] == 1 and wanted(headers) and client.lrem(key, 1, raw) == 1:
                    return TakenMessage(queue=queue, headers=headers)
            return None
        finally:
            client.close()

    def close(self, *, namespace: str, queues: list[str]) -> None:
        self.kill()


class TcpProxy:
    """A loopback TCP forwarder that can be cut (connections reset, port closed) and restored, or frozen:
    every connection stays open and nothing is forwarded either way until ``thaw`` (a server that
    stalls, a network that stops delivering for a while), then everything flows again."""

    def __init__(self, *, target: tuple[str, int], port: int | None = None, freeze_only: bytes = b"") -> None:
        self.target = target
        self.port = port or free_port()
        # non-empty: a freeze holds only the connections whose client has sent these bytes (b"SYNC": a Redis
        # replica's replication stream), every other connection keeps flowing
        self.freeze_only = freeze_only
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._frozen = threading.Event()
        self.accepted = 0  # connections accepted so far
        self.frozen_connections = 0  # connections open when the last freeze began or opened during it

    def start(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.2)
        self._listener = listener
        self._stop.clear()
        self._thread = threading.Thread(target=self._accept_loop, name="chaos-proxy", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.update((client, upstream))
                self.accepted += 1
                if self._frozen.is_set():
                    self.frozen_connections += 1
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        held = not self.freeze_only  # does a freeze hold this connection (``freeze_only``)?
        try:
            while not self._stop.is_set():
                if held and self._frozen.is_set():  # read nothing: the peers' bytes wait in their kernels' buffers
                    time.sleep(0.05)
                    continue
                readable, _, _ = select.select([a, b], [], [], 0.2)
                if held and self._frozen.is_set():  # frozen while waiting: what arrived stays unread too
                    continue
                for src in readable:
                    data = src.recv(65536)
                    if not data:
                        return
                    if src is a and not held and self.freeze_only in data:
                        held = True
                    (b if src is a else a).sendall(data)
        except (OSError, ValueError):
            return
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()
            with self._lock:
                self._conns.difference_update((a, b))

    def cut(self) -> None:
        """Refuse new connections and reset the live ones, like a broker that went away."""
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            conns = list(self._conns)
            self._conns.clear()
        for s in conns:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def restore(self) -> None:
        self.start()

    def freeze(self) -> None:
        """Stop forwarding, keep every connection (see the class docstring)."""
        with self._lock:
            self.frozen_connections = len(self._conns) // 2
            self._frozen.set()

    def thaw(self) -> None:
        self._frozen.clear()


class RabbitBroker:
    """The shared RabbitMQ behind a cuttable proxy; the run's namespace keeps its queues apart."""

    kind = "rabbitmq"

    def __init__(self, *, upstream_url: str = SHARED_RABBITMQ_URL) -> None:
        self.upstream_url = upstream_url
        rest = upstream_url.split("@", 1)[-1]
        hostport = rest.split("/", 1)[0]
        self._hostport = hostport
        host, _, port = hostport.partition(":")
        self._host, self._port = host or "127.0.0.1", int(port or 5672)
        self.proxy = TcpProxy(target=(self._host, self._port))
        self.restarts = 0

    @property
    def url(self) -> str:
        return self.upstream_url.replace(self._hostport, f"127.0.0.1:{self.proxy.port}", 1)

    def start(self) -> None:
        self.proxy.start()

    def outage_begin(self) -> None:
        self.proxy.cut()

    def outage_end(self) -> None:
        self.proxy.restore()
        self.restarts += 1

    def describe_outage(self) -> str:
        return "loopback TCP proxy to the shared RabbitMQ cut (connections reset, port closed) and restored"

    def describe_take(self) -> str:
        return "basic_get + ack on a raw channel, never processed: a consumer that acked on receipt, then died"

    def take_and_lose(self, *, queue: str, wanted: Wanted, scan: int = 200) -> TakenMessage | None:
        """Take the ready messages of ``queue`` on a raw channel (``basic_get``, up to ``scan``), acknowledge
        one ``wanted`` message whose id none of the others carries, without processing it, and put the
        others back (``basic_reject`` with requeue). A second copy (a relay killed before its mark
        publishes a row twice) would bring it back without the reconciler.

        Acknowledged and dropped is the state a consumer that acks on receipt leaves when it is killed
        before recording the message: the broker has nothing left to redeliver. None: nothing wanted
        is ready now.
        """
        from kombu import Connection, Queue

        with Connection(self.upstream_url, connect_timeout=5) as conn:
            channel = conn.channel()
            held = []
            try:
                source = Queue(queue, channel=channel, no_declare=True)
                for _ in range(scan):
                    message = source.get(no_ack=False)
                    if message is None:
                        break
                    held.append(message)
                copies = Counter(_message_id(m.headers or {}) for m in held)
                for message in held:
                    headers = dict(message.headers or {})
                    if copies[_message_id(headers)] == 1 and wanted(headers):
                        message.ack()
                        held.remove(message)
                        return TakenMessage(queue=queue, headers=headers)
                return None
            finally:
                for message in held:
                    message.reject(requeue=True)
                channel.close()

    def close(self, *, namespace: str, queues: list[str]) -> None:
        """Delete this run's queues and exchanges on the real server, then stop the proxy."""
        from kombu import Connection, Exchange, Queue

        with contextlib.suppress(Exception), Connection(self.upstream_url, connect_timeout=5) as conn:
            channel = conn.channel()
            for q in queues:
                with contextlib.suppress(Exception):
                    Queue(q, channel=channel).delete()
            for ex in (f"{namespace}.events", f"{namespace}.relay"):
                with contextlib.suppress(Exception):
                    Exchange(ex, channel=channel).delete()
        self.proxy.cut()


def make_broker(kind: str, *, data_dir: Path) -> RedisBroker | RabbitBroker:
    if kind == "redis":
        return RedisBroker(data_dir=data_dir)
    if kind == "rabbitmq":
        return RabbitBroker()
    from celery_outbox.errors import ConfigError

    raise ConfigError(f"broker must be redis or rabbitmq, got {kind!r}")
