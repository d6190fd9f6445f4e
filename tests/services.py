"""Is a real service there? Locally a missing one skips its tests with the reason; under CI=true it fails them."""

from __future__ import annotations

import os
import socket

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_service(name: str, host: str, port: int) -> None:
    """Skip (locally) or fail (CI=true) when a service does not accept connections."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return
    except OSError as e:
        reason = f"{name} is not reachable on {host}:{port} ({e}); start it with ../shared/services-up.sh"
        if IN_CI:
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
