"""A real PgBouncer (Debian's ``pgbouncer``) in front of the local Postgres, on a free loopback port.

Used by the tests in this directory and by ``bench/pooler_latency.py``: the same configuration a
production deployment would run in front of the library (docs/deployment.md, "Production Postgres and
Redis"): ``pool_mode = transaction``, trust authentication for the roles it lists, and ``options`` in
``ignore_startup_parameters`` (PgBouncer 1.18 refuses a client that sends it otherwise, and
``make_engine`` sends the statement and idle-in-transaction timeouts there; behind a pooler they are
set on the role instead). PgBouncer refuses to run as root: as root it is started with ``-u`` and the
owner of the Postgres server (``postgres``), after reading its configuration.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import sqlalchemy as sa

SEARCH = ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer")
RUN_AS = "postgres"  # as root: the user PgBouncer switches to (``-u``)


def find_pgbouncer() -> str | None:
    """The ``pgbouncer`` executable (PATH, then Debian's /usr/sbin), or None when it is not installed."""
    found = shutil.which("pgbouncer")
    if found:
        return found
    return next((p for p in SEARCH if os.access(p, os.X_OK)), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PgBouncer:
    """One PgBouncer process: ``with PgBouncer(...) as bouncer: bouncer.url(direct_url)``.

    ``users``: the roles clients may connect as (trust authentication: listed, no password);
    ``pool_mode``: ``transaction`` (the case that breaks session state) or ``session``.
    """

    def __init__(self, *, executable: str, users: Sequence[str] = ("postgres",), pool_mode: str = "transaction",
                 upstream: tuple[str, int] = ("127.0.0.1", 5432), pool_size: int = 20,
                 max_client_conn: int = 400) -> None:
        self.executable = executable
        self.users = tuple(users)
        self.pool_mode = pool_mode
        self.upstream = upstream
        self.pool_size = pool_size
        self.max_client_conn = max_client_conn
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None

    @property
    def log_path(self) -> Path:
        assert self._dir is not None
        return self._dir / "pgbouncer.log"

    def config(self) -> str:
        host, port = self.upstream
        return "\n".join([
            "[databases]",
            f"* = host={host} port={port}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {self._dir}/users.txt",
            f"pool_mode = {self.pool_mode}",
            f"default_pool_size = {self.pool_size}",
            f"max_client_conn = {self.max_client_conn}",
            "ignore_startup_parameters = options",
            f"admin_users = {self.users[0]}",
            "",
        ])

    def start(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
        self._dir.chmod(0o755)  # readable by the user PgBouncer switches to
        self.port = free_port()
        (self._dir / "users.txt").write_text("".join(f'"{u}" ""\n' for u in self.users))
        ini = self._dir / "pgbouncer.ini"
        ini.write_text(self.config())
        for f in (ini, self._dir / "users.txt"):
            f.chmod(0o644)
        argv = [self.executable]
        if os.geteuid() == 0:
            pwd.getpwnam(RUN_AS)  # KeyError: no such user to run as
            argv += ["-u", RUN_AS]
        argv.append(str(ini))
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {self.proc.returncode}: {self.log_path.read_text()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"pgbouncer did not listen on 127.0.0.1:{self.port} within 15 s")

    def url(self, direct_url: str) -> str:
        """``direct_url`` (a database on the upstream Postgres) reached through this PgBouncer instead."""
        return sa.make_url(direct_url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    def show(self, what: str) -> list[dict[str, object]]:
        """``SHOW <what>`` on PgBouncer's admin console (``STATS``, ``CLIENTS``, ``SERVERS``, ``POOLS``)."""
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user=self.users[0], dbname="pgbouncer")
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f"SHOW {what}")
                names = [d[0] for d in cur.description or ()]
                return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        finally:
            conn.close()

    def transactions(self, database: str) -> int:
        """Transactions PgBouncer has passed to ``database`` since it started (``SHOW STATS``)."""
        return sum(int(str(r["total_xact_count"])) for r in self.show("STATS") if r["database"] == database)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)  # PgBouncer: immediate shutdown
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> PgBouncer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
