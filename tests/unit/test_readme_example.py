"""The README's opening example runs as shown: the block under "In ten lines" is executed on SQLite, then
one in-process relay pass delivers its event to its consumer once."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from celery_outbox import Outcome
from celery_outbox.testing import run_pending

ROOT = Path(__file__).resolve().parents[2]
TITLE = "## In ten lines (plain SQLAlchemy)\n"


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(TITLE):]
    section = section[:section.find("\n## ", len(TITLE))]
    blocks: list[str] = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"expected one python block under {TITLE.strip()!r}, found {len(blocks)}"
    return blocks[0]


def test_the_readme_example_publishes_and_its_consumer_runs_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # Given the README's example run as written, in an empty directory, with no OUTBOX_* setting around it
    for key in [k for k in os.environ if k.startswith("OUTBOX_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    code = readme_example()
    body = [line for line in code.splitlines()
            if line.strip() and not line.startswith(("import ", "from ", "if __name__ == "))]
    assert len(body) <= 10, body  # "in ten lines", the imports and the __main__ guard apart
    namespace: dict[str, object] = {"__name__": "__main__"}  # `python shop.py`
    exec(compile(code, "README.md", "exec"), namespace)
    outbox = namespace["outbox"]
    try:
        # When one relay pass runs in the test's process
        outcomes = run_pending(outbox)  # type: ignore[arg-type]
        # Then the committed event reached its consumer once, and the consumer printed the order id
        assert outcomes == {"notify": [Outcome.PROCESSED]}
        assert capsys.readouterr().out == "order 42\n"
        assert run_pending(outbox) == {}  # type: ignore[arg-type]
    finally:
        outbox.close()  # type: ignore[attr-defined]
        namespace["engine"].dispose()  # type: ignore[attr-defined]


def test_the_readme_example_names_the_broker_its_relay_publishes_to(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the README's example as written, with no OUTBOX_* setting around it (a pip user's first try)
    for key in [k for k in os.environ if k.startswith("OUTBOX_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "shop"}
    exec(compile(readme_example(), "README.md", "exec"), namespace)
    outbox = namespace["outbox"]
    try:
        # Then the `outbox -A shop relay` the README names next has a broker to publish to (it refuses a Celery
        # app that names none: "bad configuration: no broker"), the one `celery -A shop worker` reads from
        assert outbox.broker_url() == "amqp://localhost"  # type: ignore[attr-defined]
    finally:
        outbox.close()  # type: ignore[attr-defined]
        namespace["engine"].dispose()  # type: ignore[attr-defined]


def test_importing_the_readme_example_places_no_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given the README's example saved as shop.py, When `celery -A shop worker` and `outbox -A shop relay` import it
    (as the module ``shop``, each in its own process), Then no order is placed by the import: the one order is
    `python shop.py`'s, so the consumer prints it once, not once more per process that imported shop."""
    for key in [k for k in os.environ if k.startswith("OUTBOX_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    for _process in ("worker", "relay"):
        namespace: dict[str, object] = {"__name__": "shop"}
        exec(compile(readme_example(), "README.md", "exec"), namespace)
        outbox = namespace["outbox"]
        try:
            assert run_pending(outbox) == {}  # type: ignore[arg-type]
        finally:
            outbox.close()  # type: ignore[attr-defined]
            namespace["engine"].dispose()  # type: ignore[attr-defined]
