"""Redis behind Sentinel on loopback: a primary, a replica and three sentinels, from Debian's redis-server,
that a test can fail over by SIGKILLing the primary.

Both data nodes run with the durability docs/failure-matrix.md requires of any Redis broker (``--appendonly yes
--appendfsync always --maxmemory-policy noeviction``): what Sentinel loses is what replication had not
carried yet, not what a node had not written down. The sentinels (``redis-server <conf> --sentinel``)
watch the master ``MASTER`` with a quorum of 2, call it down after ``down_after_ms`` and promote the
replica; clients find the master through them (kombu's ``sentinel://`` transport, ``master_name``).

The primary is reached through a loopback proxy (chaos/broker.py's ``TcpProxy``): the sentinels monitor
it at the proxy's address, the replica replicates from there and clients are sent there, so the
replica's configured master is the one the sentinels know (a replica pointing elsewhere is
"fixed" by them within seconds, bypassing any proxy of its own). ``pause_replication`` freezes only
the replication stream (the connection that sent ``SYNC``): the primary goes on accepting writes
(Redis replication is asynchronous; nothing waits for the replica) and what it sends waits in the
proxy; ``kill_primary`` kills the primary and cuts the proxy, so those writes die with it. That is
the window in which a Sentinel failover loses messages the old primary
acknowledged, made deterministic. Used by tests/production/test_redis_sentinel.py and bench/failover.py.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from chaos.broker import TakenMessage, TcpProxy, Wanted, redis_binary
from relay.embedded import EmbeddedServerError, free_port

MASTER = "outbox"
DURABLE = ["--appendonly", "yes", "--appendfsync", "always", "--maxmemory-policy", "noeviction", "--save", ""]


def sentinel_missing() -> str | None:
    """Why a Sentinel group cannot be started here (None when it can)."""
    try:
        binary = redis_binary()
    except Exception as e:  # relay.embedded raises when no redis-server is found
        return f"redis-server not found ({e}): install Debian's redis-server package to run the Sentinel tests"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout
    if "v=" not in out:
        return f"{binary} --version answered {out.strip()!r}: not a redis-server"
    return None


def _client(port: int) -> Any:
    import redis

    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=2,
                       decode_responses=True)


def _ask(port: int, fn: Callable[[Any], Any], default: Any = None) -> Any:
    """``fn(client)`` against the server on ``port``; ``default`` when it does not answer."""
    import redis

    client = _client(port)
    try:
        return fn(client)
    except (redis.RedisError, OSError):
        return default
    finally:
        client.close()


@dataclass(kw_only=True)
class Server:
    name: str
    port: int
    proc: subprocess.Popen[bytes] | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass(kw_only=True)
class SentinelGroup:
    """See the module docstring. Use as a context manager (or ``start()`` / ``close()``)."""

    workdir: Path | None = None
    down_after_ms: int = 1000
    failover_timeout_ms: int = 5000
    data_nodes: list[Server] = field(default_factory=list)
    sentinels: list[Server] = field(default_factory=list)
    repl_proxy: TcpProxy | None = None
    paused: bool = False
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._owned_dir = self.workdir is None
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="outbox-sentinel-"))
        if not self.data_nodes:
            self.data_nodes = [Server(name="redis-a", port=free_port()), Server(name="redis-b", port=free_port())]
        if not self.sentinels:
            self.sentinels = [Server(name=f"sentinel-{i}", port=free_port()) for i in (1, 2, 3)]

    # -- URLs ----------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The broker URL every client is given: each sentinel, ``;``-separated (kombu's form)."""
        return ";".join(f"sentinel://127.0.0.1:{s.port}/0" for s in self.sentinels)

    def master_port(self) -> int | None:
        """The port the sentinels name as the master now (None when none answers)."""
        for s in self.sentinels:
            addr = _ask(s.port, lambda c: c.sentinel_get_master_addr_by_name(MASTER))
            if addr:
                return int(addr[1])
        return None

    # -- lifecycle -----------------------------------------------------------------------------------
    def _spawn(self, server: Server, argv: list[str]) -> None:
        assert self.workdir is not None
        log = open(self.workdir / f"{server.name}.log", "ab")  # noqa: SIM115 - handed to the child
        server.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                       start_new_session=True)
        log.close()

    def _await(self, server: Server, *, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not _ask(server.port, lambda c: c.ping(), False):
            if not server.alive() or time.monotonic() > deadline:
                raise EmbeddedServerError(f"{server.name} did not start; see {self.workdir}/{server.name}.log")
            time.sleep(0.05)

    def start(self, *, timeout_s: float = 30.0) -> None:
        reason = sentinel_missing()
        if reason:
            raise EmbeddedServerError(reason)
        assert self.workdir is not None
        began = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        binary = redis_binary()
        primary, replica = self.data_nodes
        try:
            for node in self.data_nodes:
                (self.workdir / node.name).mkdir(exist_ok=True)
            self._spawn(primary, [binary, "--port", str(primary.port), "--bind", "127.0.0.1",
                                  "--dir", str(self.workdir / primary.name), *DURABLE])
            self._await(primary)
            self.repl_proxy = TcpProxy(target=("127.0.0.1", primary.port), freeze_only=b"SYNC")
            self.repl_proxy.start()
            self._spawn(replica, [binary, "--port", str(replica.port), "--bind", "127.0.0.1",
                                  "--dir", str(self.workdir / replica.name), *DURABLE,
                                  "--replicaof", "127.0.0.1", str(self.repl_proxy.port)])
            self._await(replica)
            self._wait(lambda: _ask(replica.port, lambda c: c.info("replication"), {}).get("master_link_status") == "up",
                       timeout_s, "the replica in sync")
            for s in self.sentinels:
                conf = self.workdir / f"{s.name}.conf"
                conf.write_text(
                    f"port {s.port}\nbind 127.0.0.1\ndir {self.workdir}\n"
                    f"sentinel monitor {MASTER} 127.0.0.1 {self.repl_proxy.port} 2\n"
                    f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}\n"
                    f"sentinel failover-timeout {MASTER} {self.failover_timeout_ms}\n"
                    f"sentinel parallel-syncs {MASTER} 1\n"
                )
                self._spawn(s, [binary, str(conf), "--sentinel"])
            for s in self.sentinels:
                self._await(s)
            # every sentinel knows the replica and the other sentinels before anything fails
            self._wait(lambda: all(self._sentinel_sees(s) for s in self.sentinels), timeout_s,
                       "the sentinels to find the replica and each other")
        except BaseException:
            self.close()
            raise
        self.timings["start_s"] = time.monotonic() - began

    def _sentinel_sees(self, s: Server) -> bool:
        info = _ask(s.port, lambda c: c.sentinel_master(MASTER), {})
        return bool(info.get("num-slaves") == 1 and info.get("num-other-sentinels") == 2)

    def _wait(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise EmbeddedServerError(f"timed out after {timeout_s:.0f}s waiting for {what}; see {self.workdir}")
            time.sleep(0.1)

    def pause_replication(self) -> None:
        """Stop forwarding the primary's replication stream (see the module docstring)."""
        assert self.repl_proxy is not None
        self.repl_proxy.freeze()
        self.paused = True

    def kill_primary(self) -> None:
        """SIGKILL the data node the sentinels name as master (no shutdown save, no goodbye)."""
        port = self.master_port()
        proxied = self.repl_proxy is not None and port == self.repl_proxy.port
        node = self.data_nodes[0] if proxied else next(n for n in self.data_nodes if n.port == port)
        if node.proc is not None:
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait(timeout=10)
        node.proc = None
        if self.repl_proxy is not None:  # what the frozen proxy held dies with the primary
            self.repl_proxy.cut()

    def wait_failover(self, old_port: int, *, timeout_s: float = 60.0) -> float:
        """Until every sentinel names a new master that answers as one; seconds it took."""
        began = time.monotonic()

        def promoted() -> bool:
            ports = set()
            for s in self.sentinels:
                addr = _ask(s.port, lambda c: c.sentinel_get_master_addr_by_name(MASTER))
                ports.add(int(addr[1]) if addr else 0)
            if len(ports) != 1 or old_port in ports or 0 in ports:
                return False
            return bool(_ask(ports.pop(), lambda c: c.info("replication"), {}).get("role") == "master")

        self._wait(promoted, timeout_s, "the sentinels to promote the replica")
        return time.monotonic() - began

    def close(self) -> None:
        """Kill every server this group started (by its own process) and delete its directory."""
        if self.repl_proxy is not None:
            self.repl_proxy.cut()
        for server in (*self.sentinels, *self.data_nodes):
            if server.proc is not None and server.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    server.proc.send_signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.proc.wait(timeout=10)
        if self._owned_dir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> SentinelGroup:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class SentinelBroker:
    """The chaos broker protocol (chaos/broker.py) over a ``SentinelGroup``: the processes get its
    ``sentinel://`` URL (and ``OUTBOX_BROKER_SENTINEL_MASTER``: ``ENV``); the failover run kills the
    primary itself, so an outage here is the primary's SIGKILL and the sentinels' promotion."""

    kind = "redis"
    ENV = {"OUTBOX_BROKER_SENTINEL_MASTER": MASTER}

    def __init__(self, group: SentinelGroup) -> None:
        self.group = group
        self.restarts = 0

    @property
    def url(self) -> str:
        return self.group.url

    def start(self) -> None:
        """The group is started outside any one environment."""

    def outage_begin(self) -> None:
        self.group.kill_primary()

    def outage_end(self) -> None:
        port = self.group.master_port()
        self.group.wait_failover(port or 0)
        self.restarts += 1

    def describe_outage(self) -> str:
        return "the Redis primary SIGKILLed; the sentinels promote its replica"

    def describe_take(self) -> str:
        return "not provoked behind Sentinel (its run loses what replication had not carried)"

    def take_and_lose(self, *, queue: str, wanted: Wanted) -> TakenMessage | None:
        return None

    def close(self, *, namespace: str, queues: list[str]) -> None:
        """The group is closed by whoever started it (its data goes with it)."""
