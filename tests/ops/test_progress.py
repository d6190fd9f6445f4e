"""Long work shows progress: the core calls back per prune batch and per replayed dead letter; the CLI
prints plain lines when stdout is not a terminal (and rich bars when it is), then a summary."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.cli import cli
from celery_outbox.cli.progress import ProgressView
from celery_outbox.clock import ManualClock, SystemClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.ops import dead_letters as dl
from celery_outbox.ops import retention
from celery_outbox.schema import Tables
from tests.ops_seed import T0, consumer_dead_letter, envelope, inbox_rows, outbox_row

DAY = 86_400_000


def seed_prunable(sessions: sessionmaker[Session], tables: Tables, now: int) -> None:
    """5 inbox rows and 3 published rows past retention, plus rows that must stay."""
    with sessions() as s:
        inbox_rows(s, tables=tables, consumer="shipping", processed_at_ms=now - 3 * DAY, n=5)
        inbox_rows(s, tables=tables, consumer="shipping", processed_at_ms=now - 1000, n=2)
        for _ in range(3):
            outbox_row(s, tables=tables, created_at_ms=now - 5 * DAY, published_at_ms=now - 3 * DAY)
        outbox_row(s, tables=tables, created_at_ms=now - 1000)  # pending: never pruned


# -- the core's callbacks ------------------------------------------------------------------------

def test_prune_calls_back_per_batch(any_sessions: sessionmaker[Session], tables: Tables,
                                    clock: ManualClock) -> None:
    clock.set(T0 + 10 * DAY)
    seed_prunable(any_sessions, tables, clock.now_ms())
    seen: list[retention.PruneProgress] = []
    report = retention.prune(any_sessions, tables=tables, inbox_older_than_ms=2 * DAY, published_older_than_ms=DAY,
                             batch=2, clock=clock, redelivery_window_ms=DAY, progress=seen.append)
    steps = [(p.target, p.batch, p.deleted, p.total_deleted, p.expected) for p in seen]
    # one start per side with the count it expects, then one call per committed batch (the short one ends it)
    assert steps == [("inbox", 0, 0, 0, 5), ("inbox", 1, 2, 2, 5), ("inbox", 2, 2, 4, 5), ("inbox", 3, 1, 5, 5),
                     ("outbox", 0, 0, 0, 3), ("outbox", 1, 2, 2, 3), ("outbox", 2, 1, 3, 3)]
    assert (report.inbox_batches, report.outbox_batches) == (3, 2)


def test_prune_without_a_callback_does_not_count_first(sqlite_engine: sa.Engine, sqlite_sessions: sessionmaker[Session],
                                                       tables: Tables, clock: ManualClock) -> None:
    # The count is only for a progress bar: a plain prune (beat's hourly task) must not pay for it
    statements: list[str] = []
    sa.event.listen(sqlite_engine, "before_cursor_execute", lambda _c, _cu, st, *_a: statements.append(st))
    retention.prune(sqlite_sessions, tables=tables, inbox_older_than_ms=2 * DAY, published_older_than_ms=None,
                    batch=2, clock=clock, redelivery_window_ms=DAY)
    assert any(st.lstrip().upper().startswith("DELETE") for st in statements)  # the listener saw the prune
    assert not [st for st in statements if "count(" in st.lower()]


def test_replay_calls_back_per_item(sqlite_sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> None:
    clock.set(T0 + DAY)
    with sqlite_sessions() as s:
        outbox_row(s, tables=tables, dead_lettered_at_ms=T0 + 10, attempts=10, last_error="nack")
        outbox_row(s, tables=tables, dead_lettered_at_ms=T0 + 20, attempts=10, last_error="nack")
        consumer_dead_letter(s, tables=tables, consumer="shipping", env=envelope("o-1"), failed_at_ms=T0 + 30)
    sent: list[tuple[str, dict[str, Any]]] = []
    seen: list[dl.ReplayProgress] = []

    def on_progress(p: dl.ReplayProgress) -> None:
        # each call comes after its dead letter is committed: a consumer row was sent before its call
        assert len(sent) == sum(1 for q in [*seen, p] if q.result.id.source == "consumer")
        seen.append(p)

    with sqlite_sessions() as s:
        results = dl.replay_all(s, tables=tables, clock=clock, send=lambda q, m: sent.append((q, m)),
                                progress=on_progress)
    assert [(p.done, p.total) for p in seen] == [(1, 3), (2, 3), (3, 3)]
    assert [p.result for p in seen] == results and all(r.replayed for r in results)


# -- the CLI's rendering -------------------------------------------------------------------------

@pytest.fixture
def env(sqlite_url: str, tmp_home: Path, namespace: str) -> dict[str, str]:
    return {"OUTBOX_DATABASE_URL": sqlite_url, "OUTBOX_HOME": str(tmp_home), "OUTBOX_NAMESPACE": namespace,
            "OUTBOX_BROKER_URL": "memory://", "OUTBOX_BROKER_REDELIVERY_WINDOW_MS": str(2 * DAY)}


@pytest.fixture
def sessions(sqlite_url: str) -> sessionmaker[Session]:
    return make_session_factory(make_engine(sqlite_url))


def run(env: dict[str, str], *args: str) -> Result:
    sys.modules.pop("relay.app", None)  # relay.app reads OUTBOX_* at import: one fresh Outbox per run
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def test_prune_prints_progress_lines_and_a_summary_when_not_a_tty(env: dict[str, str], sessions: sessionmaker[Session],
                                                                  tables: Tables) -> None:
    seed_prunable(sessions, tables, SystemClock().now_ms())
    r = run(env, "prune", "--inbox-older-than", "2d", "--published-older-than", "1d", "--batch", "2")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[:7] == [
        "inbox: 5 row(s) to delete, in batches of 2",
        "inbox: batch 1: deleted 2 (2/5)", "inbox: batch 2: deleted 2 (4/5)", "inbox: batch 3: deleted 1 (5/5)",
        "outbox: 3 row(s) to delete, in batches of 2",
        "outbox: batch 1: deleted 2 (2/3)", "outbox: batch 2: deleted 1 (3/3)",
    ]
    assert lines[7:9] == ["inbox: deleted 5 row(s) in 3 batch(es)", "outbox: deleted 3 published row(s) in 2 batch(es)"]
    assert lines[9].startswith("summary: deleted 8 row(s) in 5 batch(es), ") and len(lines) == 10
    assert "\x1b[" not in r.stdout  # no terminal control codes in a log


def test_prune_json_stdout_stays_one_document(env: dict[str, str], sessions: sessionmaker[Session],
                                              tables: Tables) -> None:
    seed_prunable(sessions, tables, SystemClock().now_ms())
    r = run(env, "prune", "--published-older-than", "1d", "--batch", "2", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["outbox_deleted"] == 3 and r.stderr == ""


def test_replay_all_prints_a_line_per_item_and_a_summary(env: dict[str, str], sessions: sessionmaker[Session],
                                                         tables: Tables) -> None:
    now = SystemClock().now_ms()
    with sessions() as s:
        dead = outbox_row(s, tables=tables, created_at_ms=now - 120_000, dead_lettered_at_ms=now - 60_000,
                          attempts=10, last_error="nack")
        cdl = consumer_dead_letter(s, tables=tables, consumer="shipping", env=envelope("o-1"),
                                   failed_at_ms=now - 10_000)
    r = run(env, "dead-letters", "replay", "--all")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [
        f"[1/2] outbox:{dead.seq}: replayed: back in the outbox, due now",
        f"[2/2] consumer:{cdl}: replayed: re-sent to consumer 'shipping'",
        "summary: 2 replayed, 0 skipped, of 2 dead letter(s)",
    ]
    # the same ids again: each is reported skipped as it goes, and the summary counts them
    r = run(env, "dead-letters", "replay", f"outbox:{dead.seq}", f"consumer:{cdl}")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[-1] == "summary: 0 replayed, 2 skipped, of 2 dead letter(s)"
    assert r.stdout.splitlines()[0].startswith(f"[1/2] outbox:{dead.seq}: skipped: ")


def test_a_terminal_gets_a_progress_bar(sqlite_sessions: sessionmaker[Session], tables: Tables,
                                        clock: ManualClock) -> None:
    # Given a terminal (rich forced on a buffer); When a prune reports through the CLI's view
    clock.set(T0 + 10 * DAY)
    seed_prunable(sqlite_sessions, tables, clock.now_ms())
    out = io.StringIO()
    with ProgressView(stream=out, live=True) as view:
        def step(p: retention.PruneProgress) -> None:
            if p.batch == 0:
                view.start(p.target, f"pruning {p.target}", p.expected, line="never shown on a terminal")
            else:
                view.update(p.target, p.total_deleted, p.expected, line="never shown on a terminal")

        retention.prune(sqlite_sessions, tables=tables, inbox_older_than_ms=2 * DAY, published_older_than_ms=DAY,
                        batch=2, clock=clock, redelivery_window_ms=DAY, progress=step)
    # Then it drew bars, complete at the end, with control codes rather than one line per batch
    text = out.getvalue()
    assert "pruning inbox" in text and "5/5" in text and "pruning outbox" in text and "3/3" in text
    assert "\x1b[" in text and "━" in text and "never shown" not in text
