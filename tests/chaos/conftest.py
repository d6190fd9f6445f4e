"""Chaos fixtures: a ChaosEnvironment per test (own Postgres database, own namespace, a broker)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from celery_outbox.schema import Tables
from chaos.environment import ChaosEnvironment
from tests.services import require_service


def _env(kind: str, tmp_path: Path, tables: Tables) -> Iterator[ChaosEnvironment]:
    require_service("PostgreSQL", "127.0.0.1", 5432)
    if kind == "rabbitmq":
        require_service("RabbitMQ", "127.0.0.1", 5672)
    env = ChaosEnvironment(broker=kind, workdir=tmp_path / "chaos", tables=tables)
    with env:
        yield env
        # On failure the assertion message carries the logs; keep them on disk too.


@pytest.fixture
def redis_chaos(tmp_path: Path, tables: Tables) -> Iterator[ChaosEnvironment]:
    """Own redis-server (appendfsync always) on a free port, so it may be killed and restarted."""
    yield from _env("redis", tmp_path, tables)


@pytest.fixture
def rabbit_chaos(tmp_path: Path, tables: Tables) -> Iterator[ChaosEnvironment]:
    """The shared RabbitMQ behind a cuttable loopback proxy, under a unique namespace."""
    yield from _env("rabbitmq", tmp_path, tables)


@pytest.fixture(params=["redis", "rabbitmq"])
def chaos_env(request: pytest.FixtureRequest, tmp_path: Path, tables: Tables) -> Iterator[ChaosEnvironment]:
    yield from _env(str(request.param), tmp_path, tables)


@pytest.fixture
def require() -> Callable[[str, str, int], None]:
    """``require(name, host, port)``: skip locally / fail under CI when a service is down."""
    return require_service
