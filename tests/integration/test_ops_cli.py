"""``outbox dead-letters|prune|stats`` on SQLite and Postgres: output, exit codes, bad input changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.cli import cli
from celery_outbox.clock import SystemClock
from tests.ops_seed import consumer_dead_letter, envelope, inbox_rows, outbox_row

DAY = 86_400_000
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(any_db_url: str, tmp_home: Path, namespace: str) -> dict[str, str]:
    return {"OUTBOX_DATABASE_URL": any_db_url, "OUTBOX_HOME": str(tmp_home), "OUTBOX_NAMESPACE": namespace,
            "OUTBOX_BROKER_URL": "memory://", "OUTBOX_BROKER_REDELIVERY_WINDOW_MS": str(2 * DAY)}


def run(env: dict[str, str], *args: str) -> Result:
    # The CLI loads its Outbox by importing relay.app (OUTBOX_APP, tests/conftest.py), which reads OUTBOX_* at import:
    # forget an earlier invocation's module so this one is built from this env, as a new process would.
    sys.modules.pop("relay.app", None)
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def snapshot(any_sessions: sessionmaker[Session], tables: Tables) -> tuple[Any, ...]:
    outbox, dead_letters = tables.outbox, tables.dead_letters
    with any_sessions() as s:
        return (
            s.execute(sa.select(outbox.seq, outbox.published_at_ms, outbox.dead_lettered_at_ms,
                                outbox.attempts).order_by(outbox.seq)).all(),
            s.execute(sa.select(dead_letters.id, dead_letters.replayed_at_ms)
                      .order_by(dead_letters.id)).all(),
            s.scalar(sa.select(sa.func.count()).select_from(tables.inbox)),
        )


@pytest.fixture
def seeded(any_sessions: sessionmaker[Session], tables: Tables) -> dict[str, str]:
    now = SystemClock().now_ms()
    with any_sessions() as s:
        dead = outbox_row(s, tables=tables, created_at_ms=now - 120_000, dead_lettered_at_ms=now - 60_000,
                          attempts=10, last_error="broker nacked the message")
        outbox_row(s, tables=tables, created_at_ms=now - 30_000)
        outbox_row(s, tables=tables, created_at_ms=now - 5 * DAY, published_at_ms=now - 3 * DAY)
        c_ship = consumer_dead_letter(s, tables=tables, consumer="shipping", env=envelope("o-ship"),
                                      failed_at_ms=now - 10_000, error="RuntimeError: carrier down")
        c_bill = consumer_dead_letter(s, tables=tables, consumer="billing", env=envelope("o-bill"),
                                      failed_at_ms=now - 20_000)
        inbox_rows(s, tables=tables, consumer="shipping", processed_at_ms=now - 3 * DAY, n=3)
        inbox_rows(s, tables=tables, consumer="shipping", processed_at_ms=now - 1000, n=2)
    return {"outbox": f"outbox:{dead.seq}", "shipping": f"consumer:{c_ship}", "billing": f"consumer:{c_bill}"}


def test_list_json_and_table(env: dict[str, str], seeded: dict[str, str]) -> None:
    r = run(env, "dead-letters", "list", "--json")
    assert r.exit_code == 0, r.output
    items = json.loads(r.stdout)
    assert [i["id"] for i in items] == [seeded["outbox"], seeded["billing"], seeded["shipping"]]
    assert items[0]["error"] == "broker nacked the message" and items[0]["age_ms"] >= 60_000
    r = run(env, "dead-letters", "list", "--source", "consumer", "--consumer", "shipping", "--json")
    assert [i["id"] for i in json.loads(r.stdout)] == [seeded["shipping"]]
    r = run(env, "dead-letters", "list", "--source", "outbox", "--json")
    assert [i["id"] for i in json.loads(r.stdout)] == [seeded["outbox"]]
    r = run(env, "dead-letters", "list")
    assert r.exit_code == 0 and "3 dead letter(s)" in r.stdout and seeded["shipping"] in r.stdout
    assert "carrier down" in r.stdout


def test_show(env: dict[str, str], seeded: dict[str, str]) -> None:
    r = run(env, "dead-letters", "show", seeded["shipping"], "--json")
    assert r.exit_code == 0
    data = json.loads(r.stdout)
    assert data["consumer"] == "shipping" and data["payload"]["order_id"] == "o-ship"
    r = run(env, "dead-letters", "show", seeded["outbox"])
    assert r.exit_code == 0 and "broker nacked the message" in r.stdout and '"order_id"' in r.stdout


def test_replay_ids_and_all(env: dict[str, str], seeded: dict[str, str], any_sessions: sessionmaker[Session],
                            tables: Tables) -> None:
    r = run(env, "dead-letters", "replay", seeded["outbox"], seeded["shipping"])
    assert r.exit_code == 0, r.output
    assert f"{seeded['outbox']}: replayed" in r.stdout and f"{seeded['shipping']}: replayed" in r.stdout
    outbox_rows, consumer_rows, _ = snapshot(any_sessions, tables)
    assert all(row.dead_lettered_at_ms is None for row in outbox_rows)
    replayed = {f"consumer:{row.id}": row.replayed_at_ms for row in consumer_rows}
    assert replayed[seeded["shipping"]] is not None and replayed[seeded["billing"]] is None
    # again: reported as skipped, exit 0, nothing changes
    before = snapshot(any_sessions, tables)
    r = run(env, "dead-letters", "replay", seeded["outbox"], seeded["shipping"], "--json")
    assert r.exit_code == 0 and [x["replayed"] for x in json.loads(r.stdout)] == [False, False]
    assert snapshot(any_sessions, tables) == before
    r = run(env, "dead-letters", "replay", "--all", "--consumer", "billing")
    assert r.exit_code == 0 and f"{seeded['billing']}: replayed" in r.stdout
    r = run(env, "dead-letters", "replay", "--all")
    assert r.exit_code == 0 and "nothing to replay" in r.stdout


def test_purge(env: dict[str, str], seeded: dict[str, str], any_sessions: sessionmaker[Session], tables: Tables) -> None:
    before = snapshot(any_sessions, tables)
    r = run(env, "dead-letters", "purge", seeded["outbox"], seeded["billing"])
    assert r.exit_code == 2 and "--yes" in r.output and snapshot(any_sessions, tables) == before
    r = run(env, "dead-letters", "purge", seeded["outbox"], seeded["billing"], "--yes")
    assert r.exit_code == 0 and "purged 2" in r.stdout
    r = run(env, "dead-letters", "list", "--json")
    assert [i["id"] for i in json.loads(r.stdout)] == [seeded["shipping"]]


@pytest.mark.parametrize("args, exit_code, message", [
    (["dead-letters", "show", "42"], 2, "not a dead-letter id"),  # malformed: usage; well formed, absent: 1
    (["dead-letters", "show", "outbox:999"], 1, "does not exist"),
    (["dead-letters", "show", "consumer:999"], 1, "no such consumer dead letter"),
    (["dead-letters", "list", "--consumer", "shiping"], 2, "unknown consumer 'shiping'"),
    (["dead-letters", "list", "--source", "relay"], 2, "Invalid value for '--source'"),
    (["dead-letters", "replay", "--all", "--consumer", "nobody"], 2, "unknown consumer 'nobody'"),
    (["dead-letters", "replay"], 2, "give dead-letter ids or --all"),
    (["dead-letters", "replay", "outbox:1", "--all"], 2, "give dead-letter ids or --all"),
    (["dead-letters", "replay", "outbox:1", "--consumer", "shipping"], 2, "--consumer goes with --all"),
    (["dead-letters", "replay", "{outbox}", "consumer:999"], 1, "no such dead letter(s): consumer:999"),
    (["dead-letters", "replay", "{outbox}", "bogus"], 2, "'bogus' is not a dead-letter id"),
    (["dead-letters", "purge", "{outbox}", "outbox:999", "--yes"], 1, "outbox:999"),
    (["dead-letters", "purge", "{pending}", "--yes"], 1, "not dead-lettered"),
    (["prune", "--inbox-older-than", "7x"], 2, "is not a duration"),
    (["prune", "--published-older-than", "-1d"], 2, "is not a duration"),
    (["prune"], 2, "give --inbox-older-than and/or --published-older-than"),
    (["prune", "--inbox-older-than", "1d", "--published-older-than", "1d"], 2, "redelivery window"),
    (["prune", "--published-older-than", "1d", "--batch", "0"], 2, "--batch"),
])
def test_bad_input_is_a_clear_error_and_changes_nothing(env: dict[str, str], seeded: dict[str, str],
                                                        any_sessions: sessionmaker[Session], tables: Tables,
                                                        args: list[str], exit_code: int, message: str) -> None:
    outbox = tables.outbox
    with any_sessions() as s:
        pending = s.scalars(sa.select(outbox.seq).where(outbox.published_at_ms.is_(None),
                                                        outbox.dead_lettered_at_ms.is_(None))).one()
    args = [a.format(outbox=seeded["outbox"], pending=f"outbox:{pending}") for a in args]
    before = snapshot(any_sessions, tables)
    r = run(env, *args)
    assert r.exit_code == exit_code, r.output
    assert message in r.output
    assert "Traceback" not in r.output
    assert snapshot(any_sessions, tables) == before


def test_prune(env: dict[str, str], seeded: dict[str, str], any_sessions: sessionmaker[Session], tables: Tables) -> None:
    r = run(env, "prune", "--inbox-older-than", "2d", "--published-older-than", "1d", "--batch", "2", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert (report["inbox_deleted"], report["inbox_batches"]) == (3, 2)
    assert (report["outbox_deleted"], report["outbox_batches"]) == (1, 1)
    outbox_rows, _consumer_rows, inbox = snapshot(any_sessions, tables)
    assert inbox == 2 and len(outbox_rows) == 2  # the dead and the pending row stay
    r = run(env, "prune", "--published-older-than", "1d")
    assert r.exit_code == 0 and "deleted 0 published row(s) in 1 batch(es)" in r.stdout


def test_stats(env: dict[str, str], seeded: dict[str, str]) -> None:
    r = run(env, "stats", "--json")
    assert r.exit_code == 0, r.output
    st = json.loads(r.stdout)
    assert st["outbox"]["pending"] == 1 and 30_000 <= st["outbox"]["oldest_pending_age_ms"] < 600_000
    assert st["outbox"]["published_retained"] == 1
    assert st["dead_letters"]["total"] == 3
    assert [(g["source"], g["consumer"], g["count"]) for g in st["dead_letters"]["groups"]] == [
        ("outbox", None, 1), ("consumer", "billing", 1), ("consumer", "shipping", 1)]
    assert st["inbox"] == {"total": 5, "per_consumer": {"shipping": 5}}
    assert st["reconciled"] == {"total": 0, "events": 0, "tasks": 0, "plain_tasks": 0}
    r = run(env, "stats")
    assert r.exit_code == 0 and "dead letters: 3" in r.stdout and "shipping" in r.stdout
    assert "re-sent by the reconciler" in r.stdout


def test_bad_configuration_exits_2(env: dict[str, str]) -> None:
    r = run({**env, "OUTBOX_DATABASE_URL": "mysql://x"}, "stats")
    assert r.exit_code == 2 and "bad configuration" in r.output


def test_real_subprocess_stats_json(env: dict[str, str], seeded: dict[str, str]) -> None:
    exe = Path(sys.executable).with_name("outbox")
    # from the repository, on OUTBOX_APP=relay.app (tests/conftest.py): the reference deployment
    proc = subprocess.run([str(exe), "stats", "--json"], env={**os.environ, **env}, cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    st = json.loads(proc.stdout)
    assert st["dead_letters"]["total"] == 3 and st["outbox"]["pending"] == 1
