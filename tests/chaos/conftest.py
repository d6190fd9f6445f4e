"""Chaos fixtures: a ChaosEnvironment per test (own Postgres database, own namespace, a broker)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chaos.environment import ChaosEnvironment

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_service(name: str, host: str, port: int) -> None:
    """Skip (locally) or fail (CI=true) when a service does not accept connections."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return
    except OSError as e:
        reason = f"{name} is not reachable on {host}:{port} ({e})"
        if IN_CI:
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)


def _env(kind: str, tmp_path: Path) -> Iterator[ChaosEnvironment]:
    require_service("PostgreSQL", "127.0.0.1", 5432)
    if kind == "rabbitmq":
        require_service("RabbitMQ", "127.0.0.1", 5672)
    env = ChaosEnvironment(broker=kind, workdir=tmp_path / "chaos")
    with env:
        yield env
        # On failure the assertion message carries the logs; keep them on disk too.


@pytest.fixture
def redis_chaos(tmp_path: Path) -> Iterator[ChaosEnvironment]:
    """Own redis-server (appendfsync always) on a free port, so it may be killed and restarted."""
    yield from _env("redis", tmp_path)


@pytest.fixture
def rabbit_chaos(tmp_path: Path) -> Iterator[ChaosEnvironment]:
    """The shared RabbitMQ behind a cuttable loopback proxy, under a unique namespace."""
    yield from _env("rabbitmq", tmp_path)


@pytest.fixture(params=["redis", "rabbitmq"])
def chaos_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ChaosEnvironment]:
    yield from _env(str(request.param), tmp_path)


@pytest.fixture
def require() -> Callable[[str, str, int], None]:
    """``require(name, host, port)``: skip locally / fail under CI when a service is down."""
    return require_service
