"""Importing any library module starts no process, opens no socket and reads no OUTBOX_* variable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib, os, pkgutil, socket, subprocess, sys
events = []
real_connect = socket.socket.connect
def connect(self, *a, **k):
    events.append(("socket.connect", a))
    return real_connect(self, *a, **k)
socket.socket.connect = connect
real_popen = subprocess.Popen.__init__
def popen(self, *a, **k):
    events.append(("subprocess", a))
    return real_popen(self, *a, **k)
subprocess.Popen.__init__ = popen
real_fork = os.fork
os.fork = lambda: events.append(("fork", ())) or real_fork()
class Env(dict):
    def __getitem__(self, k):
        if str(k).startswith("OUTBOX_"): events.append(("environ", k))
        return super().__getitem__(k)
    def get(self, k, d=None):
        if str(k).startswith("OUTBOX_"): events.append(("environ", k))
        return super().get(k, d)
    def __contains__(self, k):
        if str(k).startswith("OUTBOX_"): events.append(("environ", k))
        return super().__contains__(k)
os.environ = Env(os.environ)
import celery_outbox
names = [m.name for m in pkgutil.walk_packages(celery_outbox.__path__, "celery_outbox.")
         if ".migrations" not in m.name and not m.name.startswith("celery_outbox.contrib.django")]
for name in names:
    importlib.import_module(name)
print(len(names))
print(events)
"""


def test_importing_every_library_module_has_no_side_effects(tmp_path: Path) -> None:
    # Given a clean interpreter with OUTBOX_* set to values that would fail if anything read them
    env = {"PATH": "/usr/bin:/bin", "OUTBOX_DATABASE_URL": "bogus://", "OUTBOX_BROKER_URL": "bogus://",
           "PYTHONPATH": str(ROOT)}
    # When every module of the package is imported
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    count, events = out.stdout.strip().splitlines()[-2:]
    # Then many modules were imported and none connected, spawned, forked or read the environment
    assert int(count) > 30
    assert events == "[]"
