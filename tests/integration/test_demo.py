"""The main job runs end to end: ``python -m devtools demo --orders 20`` in a subprocess exits 0.

The demo is the reference deployment's tool (not the installed ``outbox`` command): it runs from the
repository, like ``make demo``, so ``devtools``/``relay`` import and its workers find ``relay.app``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.workers, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
DEVTOOLS = [sys.executable, "-m", "devtools"]


def test_demo_runs_end_to_end_on_the_embedded_default(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_HOME"] = str(tmp_path / "var")
    proc = subprocess.run([*DEVTOOLS, "demo", "--orders", "20", "--duplicates", "3", "--timeout", "150"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "every count adds up" in out
    assert "effects: email" in out and "duplicates absorbed: email" in out  # the e-mail task, counted too
    # the embedded redis-server it started is stopped again
    assert not (tmp_path / "var" / "redis" / "redis.port").exists(), out


def test_demo_rejects_bad_arguments(tmp_path: Path) -> None:
    proc = subprocess.run([*DEVTOOLS, "demo", "--orders", "0"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "--orders" in proc.stderr


def test_bad_configuration_is_a_usage_error(tmp_path: Path) -> None:
    env = {**os.environ, "OUTBOX_RELAY_BATCH_SIZE": "lots", "OUTBOX_HOME": str(tmp_path / "var")}
    outbox_cli = Path(sys.executable).parent / "outbox"
    # run from the repository, on the reference deployment's Outbox (OUTBOX_APP=relay.app, tests/conftest.py)
    proc = subprocess.run([str(outbox_cli), "db", "upgrade"], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "OUTBOX_RELAY_BATCH_SIZE must be int" in proc.stderr
