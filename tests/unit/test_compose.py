"""docker-compose.yml is for users (no Docker engine here): it must parse and its names must agree."""

from __future__ import annotations

from pathlib import Path

import yaml

from celeryconfig import Settings

ROOT = Path(__file__).resolve().parents[2]


def load() -> dict[str, object]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def test_every_reference_names_something_defined() -> None:
    data = load()
    services = data["services"]
    volumes = data.get("volumes") or {}
    assert isinstance(services, dict) and isinstance(volumes, dict)
    assert {"postgres", "redis", "rabbitmq", "orders", "worker", "beat", "flower"} <= set(services)
    for name, svc in services.items():
        for dep in (svc.get("depends_on") or {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
        for vol in svc.get("volumes") or []:
            source = vol.split(":", 1)[0]
            assert source in volumes, f"{name} mounts undeclared volume {source}"
        assert "healthcheck" in svc or name == "migrate", f"{name} has no healthcheck"


def test_redis_is_started_durable() -> None:
    cmd = " ".join(load()["services"]["redis"]["command"])  # type: ignore[index]
    assert "--appendonly yes" in cmd and "--appendfsync always" in cmd and "noeviction" in cmd


def test_worker_consumes_every_consumer_queue_and_the_relay_queue() -> None:
    data = load()
    services = data["services"]
    assert isinstance(services, dict)
    worker = services["worker"]
    env = worker["environment"]
    settings = Settings.from_env({k: str(v) for k, v in env.items()})
    queues = worker["command"][worker["command"].index("-Q") + 1].split(",")
    expected = {settings.queue_name(c) for c in settings.consumers} | {f"{settings.namespace}.relay"}
    assert set(queues) == expected
    assert settings.effective_database_url.startswith("postgresql://")
