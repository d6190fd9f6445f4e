"""Dead letters in groups: fingerprints, listing, dry run, throttled replay and purge (archive), resumed after a
crash with an exact report, and 100,000 dead letters on Postgres (index-only listing, a 10k group, flat memory)."""

from __future__ import annotations

import errno
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import Tables
from celery_outbox.cli import cli
from celery_outbox.clock import ManualClock
from celery_outbox.db import make_engine, make_session_factory
from celery_outbox.errors import ArchiveError, NotFoundError, ValidationError
from celery_outbox.inbox.fingerprints import fingerprint, normalise
from celery_outbox.ops import dead_letter_groups as groups
from tests.ops_seed import T0, consumer_dead_letter, envelope, outbox_row

FAST = 1e9  # a rate no test waits for


def test_the_fingerprint_ignores_what_differs_per_message() -> None:
    def fp(consumer: str, error: str) -> str:
        return fingerprint(source="consumer", consumer=consumer, error=error)

    same = ["LookupError: order 42 not found in 'eu-1' (id 5f0c1e6a-9a7e-4a57-b2a4-6a0c6e2d8a11)",
            "LookupError: order 97 not found in 'us-2' (id 0b6f1e2a-1111-4a57-b2a4-6a0c6e2d8a11)"]
    assert fp("billing", same[0]) == fp("billing", same[1])
    assert normalise(same[0]) == "order <n> not found in <str> (id <uuid>)"
    assert fp("billing", same[0]) != fp("shipping", same[0])  # another consumer
    assert fp("billing", "KeyError: 'x'") != fp("billing", "ValueError: 'x'")  # another exception type
    assert fp("billing", "RuntimeError: carrier down") != fp("billing", "RuntimeError: ledger down")
    assert fingerprint(source="outbox", consumer="billing", error=same[0]) != fp("billing", same[0])


def two_groups(s: Session, tables: Tables) -> dict[str, list[str]]:
    """Given three billing dead letters for missing orders, two shipping ones for a carrier outage, one
    billing dead letter already replayed, and one relay dead letter."""
    out: dict[str, list[str]] = {"billing": [], "shipping": [], "relay": []}
    for i, order in enumerate(("1", "22", "333")):
        dl = consumer_dead_letter(s, tables=tables, consumer="billing", env=envelope(order), failed_at_ms=T0 + i * 1000,
                                  error=f"LookupError: order {order} not found")
        out["billing"].append(f"consumer:{dl}")
    for i in range(2):
        dl = consumer_dead_letter(s, tables=tables, consumer="shipping", env=envelope(f"o{i}"),
                                  failed_at_ms=T0 + 500 + i, error="RuntimeError: carrier down")
        out["shipping"].append(f"consumer:{dl}")
    gone = consumer_dead_letter(s, tables=tables, consumer="billing", error="LookupError: order 7 not found")
    row = s.get(tables.dead_letters, gone)
    assert row is not None
    row.replayed_at_ms = T0
    s.commit()
    relay = outbox_row(s, tables=tables, dead_lettered_at_ms=T0 + 9, attempts=10,
                       last_error="MessageTooLargeError: 2000000 bytes > 1048576")
    out["relay"].append(f"outbox:{relay.seq}")
    return out


def jobs(s: Session, tables: Tables) -> int:
    """Group-run job rows in outbox_counters (scopes _replay:<group>, _purge:<group>)."""
    return len([c for c in s.scalars(sa.select(tables.counters.consumer)) if c.startswith(("_replay:", "_purge:"))])


def by_consumer(found: list[groups.Group]) -> dict[str, groups.Group]:
    return {g.consumer: g for g in found}


def test_groups_list_count_first_last_and_a_sample(any_sessions: sessionmaker[Session], tables: Tables) -> None:
    with any_sessions() as s:
        ids = two_groups(s, tables)
        found = groups.list_groups(s, tables=tables)
    assert [(g.consumer, g.count) for g in found] == [("billing", 3), ("shipping", 2), ("relay:OrderPlaced", 1)]
    billing = by_consumer(found)["billing"]
    assert (billing.error_class, billing.message) == ("LookupError", "order <n> not found")
    assert (billing.first_seen_ms, billing.last_seen_ms, billing.sample_id) == (T0, T0 + 2000, ids["billing"][0])
    relay = by_consumer(found)["relay:OrderPlaced"]
    assert (relay.source, relay.sample_id, relay.message) == ("outbox", ids["relay"][0], "<n> bytes > <n>")


class Sender:
    """Records each send; can fail after the send (the broker has it, the mark never commits)."""

    def __init__(self, *, crash_after: int | None = None) -> None:
        self.sent: list[str] = []
        self.crash_after = crash_after

    def __call__(self, consumer: str, env: dict[str, Any]) -> None:
        self.sent.append(env["message_id"])
        if self.crash_after is not None and len(self.sent) == self.crash_after:
            raise KeyboardInterrupt("killed between the send and the mark")


def test_a_group_replay_sends_each_dead_letter_under_its_own_task_id(sqlite_sessions: sessionmaker[Session],
                                                                     tables: Tables, clock: ManualClock,
                                                                     outbox: Any) -> None:
    from celery_outbox.celery.sender import replay_sender
    from celery_outbox.inbox import dead_letters as store

    # Given one group of billing dead letters: two kept their delivery's task id (Flower's FAILURE), one did not
    kept = ["2d0f1a52-1b5e-4c1e-9d0a-000000000001", "2d0f1a52-1b5e-4c1e-9d0a-000000000002"]
    with sqlite_sessions() as s:
        for tid in [*kept, None]:
            env = envelope("o-g")
            store.record(s, tables=tables, consumer="billing", message_id=env["message_id"], type="OrderPlaced",
                         body=json.dumps(env), headers={}, delivery_count=3, last_error="RuntimeError: gateway down",
                         first_failed_at_ms=T0, last_failed_at_ms=T0 + 1, task_id=tid)
        s.commit()
        [group] = groups.list_groups(s, tables=tables)
    calls: list[dict[str, Any]] = []
    outbox.app.send_task = lambda name, **kw: calls.append(kw)
    # When the group is replayed through the real sender
    report = groups.replay_group(sqlite_sessions, group.id, tables=tables, clock=clock,
                                 send=replay_sender(outbox.app, outbox), rate=FAST)
    # Then each went out once: the two under their own task ids, the third as a new task
    assert report.done_now == 3
    sent = [kw["task_id"] for kw in calls]
    assert sent[:2] == kept and sent[2] not in kept and len(sent) == 3


def test_dry_run_says_where_and_changes_nothing(any_sessions: sessionmaker[Session], tables: Tables,
                                                clock: ManualClock) -> None:
    with any_sessions() as s:
        two_groups(s, tables)
        gid = by_consumer(groups.list_groups(s, tables=tables))["billing"].id
    send = Sender()
    report = groups.replay_group(any_sessions, gid, tables=tables, clock=clock, send=send, dry_run=True, rate=FAST)
    assert report.plan == {"consumer billing": 3} and report.done_now == 0 and send.sent == []
    with any_sessions() as s:
        assert by_consumer(groups.list_groups(s, tables=tables))["billing"].count == 3
        assert jobs(s, tables) == 0  # no job row either


def test_a_group_replay_killed_midway_resumes_and_reports_each_once(any_sessions: sessionmaker[Session], tables: Tables,
                                                                     clock: ManualClock) -> None:
    with any_sessions() as s:
        ids = two_groups(s, tables)
        gid = by_consumer(groups.list_groups(s, tables=tables))["billing"].id
    # Given a replay of the billing group killed after its second send, before that send's mark committed
    first = Sender(crash_after=2)
    with pytest.raises(KeyboardInterrupt):
        groups.replay_group(any_sessions, gid, tables=tables, clock=clock, send=first, rate=FAST)
    # When it is run again
    second = Sender()
    report = groups.replay_group(any_sessions, gid, tables=tables, clock=clock, send=second, rate=FAST)
    # Then the report counts every dead letter once: one by the first run, two by this one, 3 of 3
    assert (report.done_before, report.done_now, report.total, report.skipped) == (1, 2, 3, 0)
    assert report.resumed_from_ms == clock.now_ms()
    # and only the message in flight at the kill went out twice (the inbox absorbs it)
    assert len(first.sent + second.sent) == 4 and len(set(first.sent + second.sent)) == 3
    with any_sessions() as s:
        replayed = {f"consumer:{i}" for i in s.scalars(sa.select(tables.dead_letters.id).where(
            tables.dead_letters.replayed_at_ms.is_not(None)))}
        assert set(ids["billing"]) <= replayed and not set(ids["shipping"]) & replayed
        assert "billing" not in by_consumer(groups.list_groups(s, tables=tables))
        assert jobs(s, tables) == 0  # the job is closed
    with pytest.raises(NotFoundError):  # nothing left in the group
        groups.replay_group(any_sessions, gid, tables=tables, clock=clock, send=second, rate=FAST)


def test_a_group_replay_is_throttled(any_sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> None:
    with any_sessions() as s:
        two_groups(s, tables)
        gid = by_consumer(groups.list_groups(s, tables=tables))["billing"].id
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    groups.replay_group(any_sessions, gid, tables=tables, clock=clock, send=Sender(), rate=2.0, sleep=sleep,
                        monotonic=lambda: now[0])
    assert now[0] == pytest.approx(1.0)  # three at 2/s: the 2nd at 0.5 s, the 3rd at 1 s
    assert len(slept) == 2


def test_the_relay_group_goes_back_to_the_outbox(any_sessions: sessionmaker[Session], tables: Tables,
                                                 clock: ManualClock) -> None:
    with any_sessions() as s:
        ids = two_groups(s, tables)
        gid = by_consumer(groups.list_groups(s, tables=tables))["relay:OrderPlaced"].id
    report = groups.replay_group(any_sessions, gid, tables=tables, clock=clock, rate=FAST)
    assert (report.done_now, report.total) == (1, 1)
    with any_sessions() as s:
        row = s.get(tables.outbox, int(ids["relay"][0].split(":")[1]))
        assert row is not None and row.dead_lettered_at_ms is None and row.attempts == 0


def test_purge_with_archive_killed_midway_archives_each_once(any_sessions: sessionmaker[Session], tables: Tables,
                                                             clock: ManualClock, tmp_path: Path) -> None:
    with any_sessions() as s:
        ids = two_groups(s, tables)
        gid = by_consumer(groups.list_groups(s, tables=tables))["billing"].id
    archive = tmp_path / "billing.jsonl"

    def die(p: groups.RunProgress) -> None:
        raise KeyboardInterrupt("killed after the first batch committed")

    # Given a purge in batches of 2, killed after its first batch
    with pytest.raises(KeyboardInterrupt):
        groups.purge_group(any_sessions, gid, tables=tables, clock=clock, archive=archive, batch=2, rate=FAST,
                           progress=die)
    # When it runs again
    report = groups.purge_group(any_sessions, gid, tables=tables, clock=clock, archive=archive, batch=2, rate=FAST)
    assert (report.done_before, report.done_now, report.total) == (2, 1, 3)
    lines = [json.loads(x) for x in archive.read_text().splitlines()]
    assert [x["id"] for x in lines] == ids["billing"]  # each once, in order, with the raw body kept
    assert json.loads(lines[0]["body"])["payload"]["order_id"] == "1"
    with any_sessions() as s:
        left = {f"consumer:{i}" for i in s.scalars(sa.select(tables.dead_letters.id))}
    assert not set(ids["billing"]) & left and set(ids["shipping"]) <= left


def left_ids(any_sessions: sessionmaker[Session], tables: Tables) -> set[str]:
    with any_sessions() as s:
        return ({f"consumer:{i}" for i in s.scalars(sa.select(tables.dead_letters.id))}
                | {f"outbox:{i}" for i in s.scalars(sa.select(tables.outbox.seq))})


def test_two_groups_purged_into_one_archive_newer_first_are_both_kept(
        any_sessions: sessionmaker[Session], tables: Tables, clock: ManualClock, tmp_path: Path) -> None:
    # Given an archive that already holds the newer group (higher row ids) and a line cut short by a crash
    with any_sessions() as s:
        ids = two_groups(s, tables)
        found = by_consumer(groups.list_groups(s, tables=tables))
    archive = tmp_path / "a.jsonl"
    groups.purge_group(any_sessions, found["shipping"].id, tables=tables, clock=clock, archive=archive, rate=FAST)
    with archive.open("a") as f:
        f.write('{"id": "consumer:1", "bo')
    # When the older group (lower row ids) is purged into the same file
    groups.purge_group(any_sessions, found["billing"].id, tables=tables, clock=clock, archive=archive, rate=FAST)
    # Then every deleted dead letter is a whole line of the archive
    kept = []
    for line in archive.read_text().splitlines():
        if line.startswith('{"id": "consumer:1", "bo'):
            continue  # the cut line stays as it was; the next one starts on a line of its own
        kept.append(json.loads(line)["id"])
    assert sorted(kept) == sorted(ids["shipping"] + ids["billing"])
    assert not (set(kept) & left_ids(any_sessions, tables))


def test_a_full_disk_stops_the_purge_before_the_batch_is_deleted(
        any_sessions: sessionmaker[Session], tables: Tables, clock: ManualClock, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    with any_sessions() as s:
        ids = two_groups(s, tables)
        gid = by_consumer(groups.list_groups(s, tables=tables))["billing"].id
    real_fsync = os.fsync
    calls = []

    def fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:  # the second batch finds the disk full
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(ArchiveError, match="the disk is full; the batch being written was not deleted"):
        groups.purge_group(any_sessions, gid, tables=tables, clock=clock, archive=tmp_path / "a.jsonl", batch=2,
                           rate=FAST)
    assert set(ids["billing"][2:]) <= left_ids(any_sessions, tables)
    assert not set(ids["billing"][:2]) & left_ids(any_sessions, tables)


def test_an_archive_that_cannot_be_written_is_refused_before_anything_is_deleted(
        any_sessions: sessionmaker[Session], tables: Tables, clock: ManualClock, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a file the purge may not write (as a non-root user sees a read-only one; root writes anything)
    with any_sessions() as s:
        two_groups(s, tables)
        gid = by_consumer(groups.list_groups(s, tables=tables))["billing"].id
    before = left_ids(any_sessions, tables)
    real_open = os.open

    def refuse(path: str, flags: int, mode: int = 0o777) -> int:
        if str(path).endswith("locked.jsonl"):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(ArchiveError, match=r"cannot be written .*nothing was deleted"):
        groups.purge_group(any_sessions, gid, tables=tables, clock=clock, archive=tmp_path / "locked.jsonl", rate=FAST)
    assert left_ids(any_sessions, tables) == before


def bad_archives(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """An archive path each, and what the one line must say."""
    binary = tmp_path / "core.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    lines = tmp_path / "notes.txt"
    lines.write_text("shopping list\nmilk\n")
    return {"device": ("/dev/full", "a device, a pipe or a socket"), "null": ("/dev/null", "a device"),
            "directory": (str(tmp_path), "it is a directory"), "proc": ("/proc/nope/x.jsonl", "proc is a kernel view"),
            "sys": ("/sys/x.jsonl", "sys is a kernel view"), "empty": ("", "the path is empty"),
            "missing dir": (str(tmp_path / "nope" / "a.jsonl"), "its directory does not exist"),
            "binary": (str(binary), "not a dead-letter archive"), "text": (str(lines), "line 1 is not a dead-letter"),
            "stdout": ("-", "not stdout")}  # the command-line convention: never a file named "-" in the cwd


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["device", "null", "directory", "proc", "sys", "empty", "missing dir", "binary",
                                  "text", "stdout"])
def test_cli_purge_refuses_a_bad_archive_in_one_line_and_deletes_nothing(
        kind: str, any_sessions: sessionmaker[Session], tables: Tables, any_db_url: str, tmp_home: Path,
        namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    with any_sessions() as s:
        two_groups(s, tables)
        gid = by_consumer(groups.list_groups(s, tables=tables))["shipping"].id
    before = left_ids(any_sessions, tables)
    path, says = bad_archives(tmp_path)[kind]
    env = {"OUTBOX_DATABASE_URL": any_db_url, "OUTBOX_HOME": str(tmp_home), "OUTBOX_NAMESPACE": namespace,
           "OUTBOX_BROKER_URL": "memory://"}
    r = run(env, "dead-letters", "purge", "--group", gid, "--yes", "--archive", path)
    assert r.exit_code == 2, r.output
    assert says in r.output and "nothing was deleted" in r.output
    assert len(r.output.strip().splitlines()) == 1 and "unexpected" not in r.output
    assert left_ids(any_sessions, tables) == before
    assert list(work.iterdir()) == []  # and no file was made where the command ran


@pytest.mark.parametrize("raw", ["", "abc", "0123456789abcdeg", "0123456789ABCDEF", "\u0660" * 10 + "abcdef", None])
def test_a_bad_group_id_is_refused(raw: object) -> None:
    with pytest.raises(ValidationError, match="not a dead-letter group"):
        groups.check_group_id(raw)


def run(env: dict[str, str], *args: str) -> Result:
    sys.modules.pop("relay.app", None)  # built from this env, as a new process would
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def test_cli_groups_dry_run_replay_purge(any_sessions: sessionmaker[Session], tables: Tables, any_db_url: str,
                                         tmp_home: Path, namespace: str, tmp_path: Path) -> None:
    with any_sessions() as s:
        two_groups(s, tables)
    env = {"OUTBOX_DATABASE_URL": any_db_url, "OUTBOX_HOME": str(tmp_home), "OUTBOX_NAMESPACE": namespace,
           "OUTBOX_BROKER_URL": "memory://"}
    r = run(env, "dead-letters", "groups", "--json")
    assert r.exit_code == 0, r.output
    found = {g["consumer"]: g for g in json.loads(r.stdout)}
    billing, shipping = found["billing"]["id"], found["shipping"]["id"]
    r = run(env, "dead-letters", "groups")
    assert "3 group(s), 6 dead letter(s)" in r.stdout and "LookupError: order <n> not found" in r.stdout
    r = run(env, "dead-letters", "replay", "--group", billing, "--dry-run")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().endswith("would send 3 to consumer billing; 0 cannot be replayed; nothing was changed")
    r = run(env, "dead-letters", "replay", "--group", billing, "--rate", "1000")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().endswith(f"summary: group {billing}: 3 replayed; 3 of 3")
    r = run(env, "dead-letters", "purge", "--group", shipping)
    assert r.exit_code == 2 and "add --yes" in r.output
    archive = tmp_path / "a.jsonl"
    r = run(env, "dead-letters", "purge", "--group", shipping, "--yes", "--archive", str(archive))
    assert r.exit_code == 0 and f"2 of 2; archived to {archive}" in r.stdout
    r = run(env, "dead-letters", "replay", "--group", shipping)
    assert r.exit_code == 1 and f"no dead letters left in group {shipping}" in r.output
    r = run(env, "dead-letters", "replay", "--group", "nope")
    assert r.exit_code == 2 and "not a dead-letter group" in r.output and "Traceback" not in r.output


# -- 100,000 dead letters on Postgres --------------------------------------------------------------------------

def seed_many(engine: sa.Engine, *, total: int, every: int) -> tuple[str, str]:
    """``total`` dead letters: every ``every``-th in group A (billing, missing order), the rest in group B;
    each with an order of twelve lines as its body (about 1 KB, as the reference deployment's are)."""
    a = fingerprint(source="consumer", consumer="billing", error="LookupError: order 1 not found")
    b = fingerprint(source="consumer", consumer="shipping", error="RuntimeError: carrier down")
    with engine.begin() as c:
        c.exec_driver_sql(
            "INSERT INTO outbox_dead_letters (consumer, message_id, type, body, headers, delivery_count, last_error, "
            "first_failed_at_ms, last_failed_at_ms, fingerprint) "
            "SELECT CASE WHEN g %% %(every)s = 0 THEN 'billing' ELSE 'shipping' END, m::text, 'OrderPlaced', "
            "json_build_object('message_id', m::text, 'type', 'OrderPlaced', 'payload', "
            "json_build_object('order_id', g::text, 'customer_id', 'c-' || g, 'email', 'o' || g || '@example.com', "
            "'lines', (SELECT json_agg(json_build_object('sku', 'sku-' || i, 'quantity', i, 'unit_price_cents', 500)) "
            "FROM generate_series(1, 12) i)), "
            "'headers', json_build_object('correlation_id', m::text, 'entity_key', 'order:' || g), "
            "'created_at_ms', 0)::text, json_build_object('correlation_id', m::text)::jsonb, 3, "
            "CASE WHEN g %% %(every)s = 0 THEN 'LookupError: order ' || g || ' not found' ELSE 'RuntimeError: carrier down' END, "
            "g, g, CASE WHEN g %% %(every)s = 0 THEN %(a)s ELSE %(b)s END "
            "FROM (SELECT g, gen_random_uuid() AS m FROM generate_series(1, %(total)s) g) s",
            {"every": every, "total": total, "a": a, "b": b})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.exec_driver_sql("VACUUM ANALYZE outbox_dead_letters")  # statistics, and the visibility map an index-only scan reads
    return a, b


class Counting:
    """A sender that keeps nothing per message (so the memory measured is the replay's own)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, consumer: str, env: dict[str, Any]) -> None:
        self.n += 1


def replay_sampling_objects(any_sessions: sessionmaker[Session], gid: str, tables: Tables, clock: ManualClock
                            ) -> tuple[int, dict[int, int]]:
    """Replay the group; the number of live Python objects after 1,000 and after every further 3,000."""
    send = Counting()
    live: dict[int, int] = {}

    def sample(p: groups.RunProgress) -> None:
        if p.done == 1_000 or (p.done > 1_000 and p.done % 3_000 == 1_000):
            gc.collect()
            live[p.done] = len(gc.get_objects())

    report = groups.replay_group(any_sessions, gid, tables=tables, clock=clock, send=send, rate=FAST, progress=sample)
    assert send.n == report.done_now == report.total
    return report.done_now, live


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_100k_dead_letters_list_by_index_and_a_10k_group_replays_in_flat_memory(
        pg_engine: sa.Engine, pg_sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> None:
    # Given 100,000 dead letters: 10,000 in group A, 90,000 in group B
    a, b = seed_many(pg_engine, total=100_000, every=10)
    with pg_sessions() as s:
        found = {g.id: g.count for g in groups.list_groups(s, tables=tables)}
        plan = "\n".join(s.execute(sa.text(
            "EXPLAIN SELECT fingerprint, count(*), min(last_failed_at_ms), max(last_failed_at_ms), min(id) "
            "FROM outbox_dead_letters WHERE replayed_at_ms IS NULL GROUP BY fingerprint")).scalars())
        members = "\n".join(s.execute(sa.text(
            "EXPLAIN SELECT id FROM outbox_dead_letters WHERE fingerprint = :g AND replayed_at_ms IS NULL "
            "AND id > 0 ORDER BY id LIMIT 500"), {"g": a}).scalars())
    assert found == {a: 10_000, b: 90_000}
    # Then listing the groups reads the group index only, never the table
    assert "Index Only Scan using ix_outbox_dead_letters_group" in plan and "Seq Scan" not in plan
    assert "ix_outbox_dead_letters_group" in members and "Seq Scan" not in members
    # When the 10,000-row group is replayed
    done, live = replay_sampling_objects(pg_sessions, a, tables, clock)
    # Then it finishes, and memory stays flat: the live objects after 1,000, 4,000, 7,000 and 10,000 replays
    # differ by less than one batch's rows would hold (a run that kept its rows would add ~9,000 rows' worth)
    assert done == 10_000 and sorted(live) == [1_000, 4_000, 7_000, 10_000]
    assert max(live.values()) - min(live.values()) < 5_000, live
    with pg_sessions() as s:
        assert {g.id: g.count for g in groups.list_groups(s, tables=tables)} == {b: 90_000}


def test_dead_letters_written_before_fingerprints_get_them_on_upgrade(tmp_path: Path, tables: Tables) -> None:
    from celery_outbox import migrate

    # Given a database at co0003 (no fingerprint column) holding two dead letters of one failure
    url = f"sqlite:///{tmp_path}/old.db"
    migrate.upgrade(url)
    migrate.downgrade(url, "co0003")
    engine = make_engine(url)
    try:
        with engine.begin() as c:
            assert "fingerprint" not in {col["name"] for col in sa.inspect(c).get_columns("outbox_dead_letters")}
            for order in ("1", "2"):
                c.exec_driver_sql(
                    "INSERT INTO outbox_dead_letters (consumer, message_id, type, body, headers, delivery_count, "
                    "last_error, first_failed_at_ms, last_failed_at_ms) VALUES ('billing', ?, 'OrderPlaced', '{}', "
                    "'{}', 3, ?, 1, 2)", (order, f"LookupError: order {order} not found"))
        # When it is upgraded
        migrate.upgrade(url)
        assert migrate.check(url) == []
        # Then both are in one group, the one a new dead letter of that failure joins
        with make_session_factory(engine)() as s:
            [g] = groups.list_groups(s, tables=tables)
        assert (g.count, g.id) == (2, fingerprint(source="consumer", consumer="billing",
                                                  error="LookupError: order 9 not found"))
    finally:
        engine.dispose()
