"""A 3-node RabbitMQ cluster on loopback, from Debian's ``rabbitmq-server``, that a test can take apart.

Each node is its own Erlang VM: its own node name (``<tag>-n<i>@localhost``), AMQP and distribution
ports (free ports), data, log and config directories under one work directory, and no plugins
(so no management or Prometheus listener can collide with anything). All nodes and the CLI share
one Erlang cookie through ``HOME/.erlang.cookie`` of a home directory of their own; the shared
server on 5672 (its cookie, its ``/etc/rabbitmq`` files, its data) is never read or touched:
``RABBITMQ_CONF_ENV_FILE`` and ``RABBITMQ_CONFIG_FILE`` point at our files. Nodes boot in parallel;
nodes 2 and 3 then ``stop_app``, ``join_cluster`` node 1, ``start_app``. A node stopped (gracefully
with ``rabbitmqctl stop``, or SIGKILLed) and restarted on the same data directory rejoins by itself.

``RabbitCluster.url`` is the failover URL clients are given: ``amqp://u:p@127.0.0.1:A;amqp://...``
(kombu tries the next URL when one refuses). Used by tests/cluster (one cluster per test session)
and bench/cluster_node_loss.py.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from chaos.broker import TakenMessage, Wanted
from relay.embedded import EmbeddedServerError, free_port

SBIN = Path(os.environ.get("OUTBOX_RABBITMQ_SBIN", "/usr/lib/rabbitmq/bin"))
SERVER = SBIN / "rabbitmq-server"
CTL = SBIN / "rabbitmqctl"
USER = "guest"
PASSWORD = "guest"
# What a deployment's processes get to run on the cluster's quorum queues (celery_outbox/celery/config.py).
QUORUM_ENV = {"OUTBOX_BROKER_QUEUE_TYPE": "quorum"}


def rabbitmq_missing() -> str | None:
    """Why a cluster cannot be started here (None when it can): the scripts of Debian's package."""
    for path in (SERVER, CTL):
        if not os.access(path, os.X_OK):
            return (f"{path} not found: install Debian's rabbitmq-server package (apt-get install rabbitmq-server) "
                    "to run the RabbitMQ cluster tests")
    if shutil.which("erl") is None:
        return "erl (Erlang) not found on PATH: the rabbitmq-server package installs it"
    return None


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass(kw_only=True)
class Node:
    """One node: its name, ports and directories; ``proc`` is the running ``rabbitmq-server`` script."""

    index: int
    name: str
    port: int
    dist_port: int
    base: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"amqp://{USER}:{PASSWORD}@127.0.0.1:{self.port}//"


@dataclass(kw_only=True)
class RabbitCluster:
    """See the module docstring. Use as a context manager (or ``start()`` / ``close()``)."""

    workdir: Path
    size: int = 3
    tag: str = field(default_factory=lambda: f"ob{uuid.uuid4().hex[:6]}")
    nodes: list[Node] = field(default_factory=list)
    startup_s: float = 0.0  # wall time of the last ``start()``: boot + join
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.home = self.workdir / "home"
        if not self.nodes:
            for i in range(1, self.size + 1):
                base = self.workdir / f"n{i}"
                self.nodes.append(Node(index=i, name=f"{self.tag}-n{i}@localhost", port=free_port(),
                                       dist_port=free_port(), base=base))

    # -- URLs ----------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The failover URL for every node, first node first: what a cluster's users configure."""
        return ";".join(n.url for n in self.nodes)

    def url_from(self, index: int) -> str:
        """The failover URL starting at node ``index`` (1-based): spread clients over the nodes."""
        order = self.nodes[index - 1:] + self.nodes[:index - 1]
        return ";".join(n.url for n in order)

    def node(self, index: int) -> Node:
        return self.nodes[index - 1]

    # -- environment ---------------------------------------------------------------------------------
    def _env(self, node: Node | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update(HOME=str(self.home), RABBITMQ_CONF_ENV_FILE=str(self.workdir / "rabbitmq-env.conf"),
                   ERL_EPMD_ADDRESS="127.0.0.1", LC_ALL="C.UTF-8")
        if node is not None:
            env.update(
                RABBITMQ_NODENAME=node.name, RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
                RABBITMQ_NODE_PORT=str(node.port), RABBITMQ_DIST_PORT=str(node.dist_port),
                RABBITMQ_CONFIG_FILE=str(node.base / "rabbitmq.conf"),
                RABBITMQ_ENABLED_PLUGINS_FILE=str(self.workdir / "enabled_plugins"),
                RABBITMQ_MNESIA_BASE=str(node.base / "mnesia"), RABBITMQ_LOG_BASE=str(node.base / "log"),
                RABBITMQ_PID_FILE=str(node.base / "rabbitmq.pid"),
                RABBITMQ_SERVER_ERL_ARGS="+S 1:1 +A 8",  # one scheduler each: three VMs share 2 cores
            )
        return env

    def _prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(exist_ok=True)
        cookie = self.home / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(secrets.token_hex(16).upper())
            cookie.chmod(0o400)
        (self.workdir / "rabbitmq-env.conf").write_text("# empty: no /etc/rabbitmq/rabbitmq-env.conf\n")
        (self.workdir / "enabled_plugins").write_text("[].\n")
        for node in self.nodes:
            node.base.mkdir(parents=True, exist_ok=True)
            (node.base / "rabbitmq.conf").write_text(
                f"listeners.tcp.default = 127.0.0.1:{node.port}\n"
                "loopback_users = none\n"
                "cluster_partition_handling = pause_minority\n"
                # a lost node is noticed within seconds, not the default minute
                "net_ticktime = 10\n"
                "log.console = false\n"
                "log.file.level = info\n"
            )

    def ctl(self, node: Node, *args: str, timeout_s: float = 60.0, check: bool = True) -> str:
        """``rabbitmqctl -n <node> <args>`` with the cluster's cookie; its output, or raises on failure."""
        res = subprocess.run([str(CTL), "-n", node.name, *args], env=self._env(), capture_output=True,
                             timeout=timeout_s, check=False)
        out = res.stdout.decode(errors="replace") + res.stderr.decode(errors="replace")
        if check and res.returncode != 0:
            raise EmbeddedServerError(f"rabbitmqctl -n {node.name} {' '.join(args)} failed ({res.returncode}): "
                                      f"{out.strip()[-600:]}")
        return out

    # -- lifecycle -----------------------------------------------------------------------------------
    def _boot(self, node: Node) -> None:
        node.base.mkdir(parents=True, exist_ok=True)
        log = open(node.base / "server.out", "ab")  # noqa: SIM115 - handed to the child
        node.proc = subprocess.Popen([str(SERVER)], env=self._env(node), stdout=log, stderr=subprocess.STDOUT,
                                     cwd=node.base, start_new_session=True)
        log.close()
        node.starts += 1

    def _await(self, node: Node, *, timeout_s: float) -> None:
        """Until the node accepts AMQP connections and says its app is running."""
        deadline = time.monotonic() + timeout_s
        while True:
            if node.proc is not None and node.proc.poll() is not None:
                raise EmbeddedServerError(f"RabbitMQ node {node.name} exited {node.proc.returncode}; "
                                          f"see {node.base / 'log'}")
            if _port_open(node.port):
                out = self.ctl(node, "-q", "await_startup", "--timeout", "30", check=False, timeout_s=40)
                if "Error" not in out:
                    return
            if time.monotonic() > deadline:
                raise EmbeddedServerError(f"RabbitMQ node {node.name} did not start within {timeout_s:.0f}s; "
                                          f"see {node.base / 'log'}")
            time.sleep(0.1)

    def start(self, *, timeout_s: float = 120.0) -> None:
        """Boot every node in parallel, then join nodes 2.. to node 1; ``startup_s`` is the wall time."""
        reason = rabbitmq_missing()
        if reason:
            raise EmbeddedServerError(reason)
        began = time.monotonic()
        self._prepare()
        for node in self.nodes:
            self._boot(node)
        try:
            for node in self.nodes:
                self._await(node, timeout_s=timeout_s)
            self.timings["boot_s"] = time.monotonic() - began
            first = self.nodes[0]
            for node in self.nodes[1:]:
                self.ctl(node, "stop_app")
                self.ctl(node, "join_cluster", first.name)
                self.ctl(node, "start_app")
            self.timings["join_s"] = time.monotonic() - began - self.timings["boot_s"]
            self.wait_running(len(self.nodes), timeout_s=timeout_s)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.monotonic() - began

    def running_nodes(self, via: Node | None = None) -> list[str]:
        """Names of the running cluster members, as a live node sees them."""
        for node in ([via] if via else [n for n in self.nodes if self.alive(n)]):
            out = self.ctl(node, "-q", "eval", "rabbit_nodes:all_running().", check=False, timeout_s=30)
            if out.startswith("["):
                return [n.strip(" '\n[]") for n in out.split(",") if n.strip(" '\n[]")]
        return []

    def wait_running(self, count: int, *, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.running_nodes()) < count:
            if time.monotonic() > deadline:
                raise EmbeddedServerError(f"the cluster did not reach {count} running nodes within {timeout_s:.0f}s")
            time.sleep(0.3)

    def alive(self, node: Node) -> bool:
        return node.proc is not None and node.proc.poll() is None

    def _beam_pids(self, node: Node) -> list[int]:
        """The Erlang VM (and its helpers) of this node: the processes of the script's session."""
        if node.proc is None:
            return []
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if os.getsid(int(entry.name)) == node.proc.pid:
                    pids.append(int(entry.name))
        return pids

    def stop_node(self, index: int) -> None:
        """Stop a node gracefully (``rabbitmqctl stop``): its clients see their connections closed."""
        node = self.node(index)
        if not self.alive(node):
            return
        self.ctl(node, "stop", check=False, timeout_s=60)
        assert node.proc is not None
        try:
            node.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill_node(index)
        node.proc = None

    def kill_node(self, index: int) -> None:
        """SIGKILL the node's VM and everything in its session: a machine lost, no goodbye to anyone."""
        node = self.node(index)
        if node.proc is None:
            return
        for pid in self._beam_pids(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.proc.wait(timeout=30)
        node.proc = None

    def start_node(self, index: int, *, timeout_s: float = 120.0) -> float:
        """Start a stopped node on its data directory (it rejoins); seconds until the cluster has it back."""
        node = self.node(index)
        began = time.monotonic()
        if not self.alive(node):
            self._boot(node)
        self._await(node, timeout_s=timeout_s)
        self.wait_running(len(self.nodes), timeout_s=timeout_s)
        return time.monotonic() - began

    def close(self) -> None:
        """Kill every node this cluster started (by its own process ids)."""
        for node in self.nodes:
            self.kill_node(node.index)

    def __enter__(self) -> RabbitCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- queues --------------------------------------------------------------------------------------
    def queue_info(self, names: Sequence[str], columns: Sequence[str] = ("name", "type", "messages")) -> dict[str, str]:
        """``list_queues`` columns for these queue names, read through a live node (one line each)."""
        live = next((n for n in self.nodes if self.alive(n)), None)
        if live is None:
            return {}
        out = self.ctl(live, "-q", "list_queues", "--no-table-headers", *columns, timeout_s=60)
        wanted = set(names)
        rows: dict[str, str] = {}
        for line in out.splitlines():
            parts = line.split("\t")
            if parts and parts[0] in wanted:
                rows[parts[0]] = "\t".join(parts[1:])
        return rows

    def delete_queues(self, names: Sequence[str], exchanges: Sequence[str] = ()) -> None:
        """Delete these queues and exchanges through any live node (a test's namespace, at its end)."""
        from kombu import Connection, Exchange, Queue

        with contextlib.suppress(Exception), Connection(self.url, connect_timeout=5) as conn:
            channel = conn.channel()
            for q in names:
                with contextlib.suppress(Exception):
                    Queue(q, channel=channel).delete()
            for ex in exchanges:
                with contextlib.suppress(Exception):
                    Exchange(ex, channel=channel).delete()


class ClusterBroker:
    """The chaos broker protocol (chaos/broker.py) over a ``RabbitCluster``: an outage stops node 1."""

    kind = "rabbitmq"

    def __init__(self, cluster: RabbitCluster) -> None:
        self.cluster = cluster
        self.restarts = 0

    @property
    def url(self) -> str:
        return self.cluster.url

    def start(self) -> None:
        """The cluster is started once per test session, outside any one environment."""

    def outage_begin(self) -> None:
        self.cluster.stop_node(1)

    def outage_end(self) -> None:
        self.cluster.start_node(1)
        self.restarts += 1

    def describe_outage(self) -> str:
        return "node 1 of a 3-node RabbitMQ cluster stopped and restarted"

    def describe_take(self) -> str:
        return "not provoked on the cluster (its run loses nodes, not messages in the take window)"

    def take_and_lose(self, *, queue: str, wanted: Wanted) -> TakenMessage | None:
        """The cluster run provokes no take-window loss: nothing is taken."""
        return None

    def close(self, *, namespace: str, queues: list[str]) -> None:
        self.cluster.delete_queues(queues, exchanges=(f"{namespace}.events", f"{namespace}.relay"))
