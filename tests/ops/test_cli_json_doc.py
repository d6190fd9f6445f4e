"""docs/cli.md documents every ``--json`` output of the CLI, field for field, and the real outputs say the same.

Each output has a section ``### `outbox <command> --json` `` with a table whose first column is the field
(``a.b`` a field of an object, ``a[].b`` a field of each object in a list). The test walks the CLI's
commands: every command with a ``--json`` option has its section, every section names a real command.
Then it runs each one against a database seeded with dead letters, inbox rows and an outbox backlog
(SQLite, and Postgres for what only Postgres shows: the vacuum figures, the production checks and the
partitioned layout) and compares, both ways, the fields the output has with the fields the table lists.
A documented field may be missing from an output only under a parent that is null or empty in that
run, or when its type says ``optional``.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables, migrate
from celery_outbox.cli import cli
from celery_outbox.clock import SystemClock
from celery_outbox.db import make_engine, make_session_factory
from tests.conftest import scratch_database
from tests.ops_seed import consumer_dead_letter, envelope, inbox_rows, outbox_row

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
DAY = 86_400_000
_SECTION = re.compile(r"^### `outbox ([^`]+?) --json`\s*$", re.M)
PARTITION_SECTIONS = {"db partitions convert", "db partitions status", "db partitions drop"}
_ROW = re.compile(r"^\| `([^`]+)` \| ([^|]+) \|", re.M)


def documented() -> dict[str, dict[str, str]]:
    """``{"dead-letters list": {"id": "string", ...}, ...}`` from docs/cli.md (field -> type)."""
    text = DOC.read_text()
    marks = list(_SECTION.finditer(text))
    found: dict[str, dict[str, str]] = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        body = text[m.end():end].split("\n## ", 1)[0]
        found[m.group(1)] = {f: t.strip() for f, t in _ROW.findall(body)}
    return found


def json_commands(group: click.Group = cli, prefix: tuple[str, ...] = ()) -> set[str]:
    """Every CLI command (space-separated path) that has a ``--json`` option."""
    found: set[str] = set()
    for name, cmd in group.commands.items():
        path = (*prefix, name)
        if isinstance(cmd, click.Group):
            found |= json_commands(cmd, path)
        elif any("--json" in p.opts for p in cmd.params if isinstance(p, click.Option)):
            found.add(" ".join(path))
    return found


def test_every_json_output_of_the_cli_is_documented() -> None:
    docs = documented()
    # A section names a real command (with an option after it, as "dead-letters replay --group G")
    base = {re.sub(r" (--?\S.*|[A-Z<].*)$", "", s) for s in docs}
    assert json_commands() == base, (json_commands() ^ base)
    assert all(docs.values()), [s for s, fields in docs.items() if not fields]


def fields(value: Any, wanted: set[str], prefix: str = "") -> tuple[set[str], set[str]]:
    """(paths present, paths whose value is null or empty) in ``value``, descending where docs go deeper."""
    present: set[str] = set()
    empty: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            path = f"{prefix}.{k}" if prefix else k
            present.add(path)
            if v is None or v == [] or v == {}:
                empty.add(path)
            if any(w.startswith(path + ".") or w.startswith(path + "[]") for w in wanted):
                sub_p, sub_e = fields(v, wanted, path)
                present |= sub_p
                empty |= sub_e
    elif isinstance(value, list):
        for item in value:
            sub_p, sub_e = fields(item, wanted, prefix + "[]" if prefix else "")
            present |= sub_p
            empty |= sub_e
    return present, empty


def compare(section: str, output: Any) -> None:
    docs = documented()[section]
    wanted = set(docs)
    present, empty = fields(output, wanted)
    undocumented = present - wanted
    assert not undocumented, f"{section}: the output has fields docs/cli.md does not list: {sorted(undocumented)}"

    def excused(path: str) -> bool:
        return "optional" in docs[path] or any(p in empty for p in _prefixes(path))

    missing = {w for w in wanted - present if not excused(w)}
    assert not missing, f"{section}: docs/cli.md lists fields the output does not have: {sorted(missing)}"


def _prefixes(path: str) -> Iterator[str]:
    """``a[].b.c`` -> ``a``, ``a[].b`` (the parents whose emptiness explains a missing field)."""
    for m in re.finditer(r"\.|\[\]", path):
        yield path[:m.start()]


def run(env: dict[str, str], *args: str) -> Result:
    sys.modules.pop("relay.app", None)  # the CLI's app is built from this env, as in a new process
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def out(env: dict[str, str], *args: str, code: int = 0) -> Any:
    r = run(env, *args)
    assert r.exit_code == code, r.output
    return json.loads(r.stdout)


def seed(sessions: sessionmaker[Session], tables: Tables) -> dict[str, str]:
    now = SystemClock().now_ms()
    env = envelope("o-doc")
    with sessions() as s:
        dead = outbox_row(s, tables=tables, created_at_ms=now - 120_000, dead_lettered_at_ms=now - 60_000,
                          attempts=10, last_error="broker nacked the message")
        outbox_row(s, tables=tables, created_at_ms=now - 30_000)
        outbox_row(s, tables=tables, created_at_ms=now - 5 * DAY, published_at_ms=now - 3 * DAY)
        shipping = consumer_dead_letter(s, tables=tables, consumer="shipping", env=env, failed_at_ms=now - 10_000,
                                        error="RuntimeError: carrier down")
        consumer_dead_letter(s, tables=tables, consumer="billing", env=envelope("o-bill"), failed_at_ms=now - 20_000,
                             error="RuntimeError: gateway down")
        inbox_rows(s, tables=tables, consumer="search", processed_at_ms=now - 3 * DAY, n=2)
    return {"outbox": f"outbox:{dead.seq}", "shipping": f"consumer:{shipping}", "message_id": env["message_id"]}


def outputs(env: dict[str, str], ids: dict[str, str]) -> dict[str, Any]:
    """Each documented section's real output (the run order matters: replays and purges come last)."""
    got: dict[str, Any] = {
        "stats": out(env, "stats", "--json", "--fail-on-dead-letters", "--max-pending-age", "1h", code=3),
        "check": out(env, "check", "--no-broker", "--json"),
        "trace": out(env, "trace", ids["message_id"], "--json"),
        "dead-letters list": out(env, "dead-letters", "list", "--json"),
        "dead-letters show": out(env, "dead-letters", "show", ids["shipping"], "--json"),
        "dead-letters groups": out(env, "dead-letters", "groups", "--json"),
    }
    group = next(g["id"] for g in got["dead-letters groups"] if g["consumer"] == "billing")
    got["dead-letters replay --group G"] = out(env, "dead-letters", "replay", "--group", group, "--dry-run", "--json")
    got["dead-letters replay"] = out(env, "dead-letters", "replay", ids["outbox"], "--json")
    got["dead-letters purge --group G"] = out(env, "dead-letters", "purge", "--group", group, "--yes", "--json")
    got["prune"] = out(env, "prune", "--inbox-older-than", "2d", "--published-older-than", "1d", "--json")
    return got


@pytest.fixture
def cli_env(any_db_url: str, tmp_home: Path, namespace: str) -> dict[str, str]:
    return {"OUTBOX_DATABASE_URL": any_db_url, "OUTBOX_HOME": str(tmp_home), "OUTBOX_NAMESPACE": namespace,
            "OUTBOX_BROKER_URL": "memory://", "OUTBOX_BROKER_REDELIVERY_WINDOW_MS": str(DAY)}


def test_the_documented_fields_are_the_fields_each_output_has(cli_env: dict[str, str],
                                                              any_sessions: sessionmaker[Session],
                                                              tables: Tables) -> None:
    # Given a database with dead letters in both stores, a backlog and old inbox rows
    ids = seed(any_sessions, tables)
    # When every --json output is produced, each one lists exactly the fields docs/cli.md documents
    got = outputs(cli_env, ids)
    for section, output in got.items():
        compare(section, output)
    # And no documented section goes unchecked
    assert set(got) | PARTITION_SECTIONS == set(documented())


@pytest.mark.postgres
def test_the_partition_outputs_match_their_documented_fields(tmp_home: Path, namespace: str, tables: Tables) -> None:
    # Given a database of its own (the conversion changes the schema) with published rows, converted
    with scratch_database("outbox_clidoc") as url:
        migrate.upgrade(url)
        engine = make_engine(url)
        sessions = make_session_factory(engine)
        now = SystemClock().now_ms()
        with sessions() as s:
            for _ in range(3):
                outbox_row(s, tables=tables, created_at_ms=now - 5 * DAY, published_at_ms=now - 3 * DAY)
        engine.dispose()
        env = {"OUTBOX_DATABASE_URL": url, "OUTBOX_HOME": str(tmp_home), "OUTBOX_NAMESPACE": namespace,
               "OUTBOX_BROKER_URL": "memory://"}
        converted = out(env, "db", "partitions", "convert", "--size", "1000", "--json")
        status = out(env, "db", "partitions", "status", "--json")
        dropped = out(env, "db", "partitions", "drop", "--published-older-than", "1d", "--json")
    # Then each lists exactly the fields docs/cli.md documents
    compare("db partitions convert", converted)
    compare("db partitions status", status)
    compare("db partitions drop", dropped)
