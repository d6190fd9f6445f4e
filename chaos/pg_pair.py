"""A Postgres primary and a streaming standby on loopback, from Debian's PostgreSQL binaries, that a test
can fail over: SIGKILL the primary (the postmaster and every backend: a machine lost), promote the standby.

``pg_ctl promote`` of the standby after the primary is gone is what Patroni does on a failure (its
leader key expires, the healthiest replica is promoted). The clusters are initialised with ``initdb``
(trust authentication on loopback only, so the test needs no password), the standby is a
``pg_basebackup -R -X stream`` copy of the primary replicating asynchronously, as Patroni's default and
most managed services' multi-zone replicas do. initdb refuses to run as root, so under root every
Postgres command runs as the ``postgres`` user (``runuser``), in a work directory that user owns.

Clients are given one multi-host URL (``PgPair.url``): libpq tries the hosts in order and keeps the
first that accepts read-write sessions (``target_session_attrs=read-write``), so the same URL reaches
the old primary before the failover and the promoted standby after it. SQLAlchemy's URL takes the
hosts as repeated ``host=`` query parameters (docs/deployment.md, "Production Postgres and Redis").

The standby streams through a loopback proxy (chaos/broker.py's ``TcpProxy``). ``pause_replication``
freezes it: commits go on on the primary, which does not wait for an asynchronous standby, and the
WAL they wrote waits in the proxy's socket buffers; ``kill_primary`` then cuts the proxy, so those
commits die with the primary (stopping the WAL receiver instead would not do: the kernel keeps
what the primary sent and the receiver reads it after the primary is gone). That is asynchronous
replication's loss window, made deterministic. Used by tests/production and bench/pg_failover.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from chaos.broker import TcpProxy
from relay.embedded import EmbeddedServerError, free_port

PG_BIN = Path(os.environ.get("OUTBOX_PG_BIN", "/usr/lib/postgresql/15/bin"))
OS_USER = "postgres"  # who runs the clusters when we are root (initdb refuses root)


def postgres_missing() -> str | None:
    """Why a pair cannot be started here (None when it can)."""
    for name in ("initdb", "pg_ctl", "pg_basebackup", "postgres"):
        if not os.access(PG_BIN / name, os.X_OK):
            return (f"{PG_BIN / name} not found: install Debian's postgresql-15 package "
                    "(or point OUTBOX_PG_BIN at a PostgreSQL bin directory) to run the failover tests")
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "runuser not found: needed to run PostgreSQL as the postgres user under root"
    return None


def _as_owner(argv: list[str]) -> list[str]:
    return ["runuser", "-u", OS_USER, "--", *argv] if os.geteuid() == 0 else argv


@dataclass(kw_only=True)
class Node:
    """One cluster: its port and data directory; ``role`` is ``primary``, ``standby`` or ``dead``."""

    name: str
    port: int
    data: Path
    role: str

    @property
    def log(self) -> Path:
        return self.data.parent / f"{self.name}.log"


@dataclass(kw_only=True)
class PgPair:
    """See the module docstring. Use as a context manager (or ``start()`` / ``close()``)."""

    workdir: Path | None = None
    user: str = "postgres"
    nodes: list[Node] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    wal_proxy: TcpProxy | None = field(default=None, init=False)  # between the standby and the primary
    paused: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._owned_dir = self.workdir is None
        if self.workdir is None:  # under /tmp: a pytest tmp_path (mode 700, root's) is closed to postgres
            self.workdir = Path(tempfile.mkdtemp(prefix="outbox-pgpair-"))
        if not self.nodes:
            self.nodes = [Node(name="pg-a", port=free_port(), data=self.workdir / "pg-a", role="primary"),
                          Node(name="pg-b", port=free_port(), data=self.workdir / "pg-b", role="standby")]

    # -- URLs ----------------------------------------------------------------------------------------
    def url(self, database: str = "postgres") -> str:
        """The multi-host URL every client is given: both hosts, read-write sessions only."""
        hosts = "&".join(f"host=127.0.0.1:{n.port}" for n in self.nodes)
        return f"postgresql://{self.user}@/{database}?{hosts}&target_session_attrs=read-write"

    def node_url(self, node: Node, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{node.port}/{database}"

    @property
    def primary(self) -> Node:
        return next(n for n in self.nodes if n.role == "primary")

    @property
    def standby(self) -> Node:
        return next(n for n in self.nodes if n.role == "standby")

    # -- lifecycle -----------------------------------------------------------------------------------
    def _run(self, argv: list[str], *, timeout_s: float = 120.0) -> str:
        res = subprocess.run(_as_owner(argv), capture_output=True, timeout=timeout_s, check=False,
                             env={**os.environ, "LC_ALL": "C.UTF-8", "PGTZ": "UTC"})
        out = res.stdout.decode(errors="replace") + res.stderr.decode(errors="replace")
        if res.returncode != 0:
            raise EmbeddedServerError(f"{' '.join(argv[:2])} failed ({res.returncode}): {out.strip()[-800:]}")
        return out

    def start(self) -> None:
        """initdb the primary, start it, pg_basebackup the standby from it, start the standby streaming."""
        reason = postgres_missing()
        if reason:
            raise EmbeddedServerError(reason)
        assert self.workdir is not None
        began = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.workdir, user=OS_USER, group=OS_USER)
        primary, standby = self.nodes
        try:
            self._run([str(PG_BIN / "initdb"), "-D", str(primary.data), "-U", self.user, "--auth=trust", "-N",
                       "-E", "UTF8", "--locale=C.UTF-8"])
            with open(primary.data / "postgresql.conf", "a") as conf:
                conf.write(
                    f"port = {primary.port}\n"
                    "listen_addresses = '127.0.0.1'\n"
                    f"unix_socket_directories = '{self.workdir}'\n"
                    "wal_level = replica\n"
                    "max_wal_senders = 5\n"
                    "hot_standby = on\n"
                    "max_connections = 100\n"
                    "shared_buffers = 32MB\n"
                    "wal_sender_timeout = 5s\n"
                    "wal_receiver_status_interval = 1s\n"
                    "logging_collector = off\n"
                )
            self._pg_ctl("start", primary)
            self.timings["primary_s"] = time.monotonic() - began
            self._run([str(PG_BIN / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port), "-U", self.user,
                       "-D", str(standby.data), "-R", "-X", "stream", "-c", "fast"])
            self.wal_proxy = TcpProxy(target=("127.0.0.1", primary.port))
            self.wal_proxy.start()
            with open(standby.data / "postgresql.auto.conf", "a") as conf:  # later lines win over -R's
                conf.write(f"port = {standby.port}\n"
                           f"primary_conninfo = 'host=127.0.0.1 port={self.wal_proxy.port} user={self.user}'\n")
            self._pg_ctl("start", standby)
            self.wait_streaming()
        except BaseException:
            self.close()
            raise
        self.timings["start_s"] = time.monotonic() - began

    def _pg_ctl(self, action: str, node: Node, *, timeout_s: float = 60.0) -> None:
        self._run([str(PG_BIN / "pg_ctl"), action, "-D", str(node.data), "-l", str(node.log), "-w",
                   "-t", str(int(timeout_s))], timeout_s=timeout_s + 10)

    def _sql(self, node: Node, sql: str) -> str:
        """One statement through ``psql`` as the cluster's user (no driver involved)."""
        psql = PG_BIN / "psql"
        return self._run([str(psql), "-h", "127.0.0.1", "-p", str(node.port), "-U", self.user, "-d", "postgres",
                          "-At", "-c", sql], timeout_s=30).strip()

    def wait_streaming(self, *, timeout_s: float = 60.0) -> None:
        """Until the primary reports its standby streaming."""
        deadline = time.monotonic() + timeout_s
        while self._sql(self.primary, "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'") != "1":
            if time.monotonic() > deadline:
                raise EmbeddedServerError(f"the standby did not start streaming within {timeout_s:.0f}s; "
                                          f"see {self.standby.log}")
            time.sleep(0.2)

    def _postmaster_pid(self, node: Node) -> int | None:
        try:
            return int((node.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def _children(self, pid: int) -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
        return found

    def replication_lag_bytes(self) -> int:
        """WAL the primary wrote that its standby has not flushed yet (0: caught up)."""
        out = self._sql(self.primary, "SELECT coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), flush_lsn), 0)::bigint "
                                      "FROM pg_stat_replication")
        return int(out or 0)

    def set_synchronous(self, enabled: bool, *, on: Node | None = None) -> None:
        """Make ``on``'s (the primary's) standbys synchronous (a commit returns, and becomes visible to
        other sessions, once a standby flushed it) or asynchronous again."""
        node = on or self.primary
        self._sql(node, f"ALTER SYSTEM SET synchronous_standby_names = '{'*' if enabled else ''}'")
        self._sql(node, "SELECT pg_reload_conf()")

    def pause_replication(self) -> None:
        """Stop forwarding the primary's WAL to the standby (see the module docstring)."""
        assert self.wal_proxy is not None
        self.wal_proxy.freeze()
        self.paused = True

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster and every backend: nothing is flushed, nothing says goodbye."""
        node = self.primary
        pid = self._postmaster_pid(node)
        if pid is not None:
            for child in [pid, *self._children(pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        node.role = "dead"
        if self.paused and self.wal_proxy is not None:  # what the frozen proxy holds dies with the primary
            self.wal_proxy.cut()

    def promote(self, *, timeout_s: float = 60.0) -> float:
        """``pg_ctl promote`` the standby (waits until it accepts writes); seconds it took."""
        node = self.standby
        began = time.monotonic()
        self._run([str(PG_BIN / "pg_ctl"), "promote", "-D", str(node.data), "-w", "-t", str(int(timeout_s))],
                  timeout_s=timeout_s + 10)
        while self._sql(node, "SELECT pg_is_in_recovery()") != "f":
            if time.monotonic() - began > timeout_s:
                raise EmbeddedServerError(f"the standby was not promoted within {timeout_s:.0f}s; see {node.log}")
            time.sleep(0.1)
        node.role = "primary"
        return time.monotonic() - began

    def close(self) -> None:
        """Kill every cluster this pair started (by its postmaster's pid) and delete its directory."""
        if self.wal_proxy is not None:
            self.wal_proxy.cut()
        for node in self.nodes:
            pid = self._postmaster_pid(node)
            if pid is None:
                continue
            for child in [pid, *self._children(pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
        if self._owned_dir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PgPair:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
