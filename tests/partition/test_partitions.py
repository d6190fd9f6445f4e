"""The optional partitioned outbox layout on real Postgres (docs/partitioning.md): convert a live plain
table, the relay publishes from it, retention drops old partitions (never one with a pending row), a
reused message_id is still refused, revert goes back, and the CLI's bad input is one line, exit 2."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox import migrate
from celery_outbox.cli import cli
from celery_outbox.clock import ManualClock
from celery_outbox.db import is_unique_violation, make_engine, make_session_factory
from celery_outbox.errors import ConfigError, DatabaseError
from celery_outbox.ops import partitions, retention
from celery_outbox.ops import stats as ops_stats
from celery_outbox.ops.metrics import make_registry, render
from celery_outbox.relay.dispatch import dispatch_batch
from celery_outbox.schema import Tables
from celery_outbox.testing.memory import InMemoryPublisher
from tests.conftest import scratch_database

pytestmark = pytest.mark.postgres

SIZE = 1000
TABLE = "outbox_messages"


@pytest.fixture
def url() -> Iterator[str]:
    """A migrated database of its own per test: converting changes the schema, so none is shared."""
    with scratch_database("outbox_part") as db:
        migrate.upgrade(db)
        yield db


@pytest.fixture
def sessions(url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(url)
    yield make_session_factory(engine)
    engine.dispose()


def insert(sessions: sessionmaker[Session], n: int, *, published_at: int | None, tag: str) -> None:
    with sessions() as s:
        s.execute(sa.text(
            f"INSERT INTO {TABLE} (message_id, type, payload, headers, created_at_ms, published_at_ms, attempts, "
            "next_attempt_at_ms) SELECT md5(g::text || :tag)::uuid, 'OrderPlaced', '{}'::jsonb, '{}'::jsonb, g, "
            ":pub, 0, 0 FROM generate_series(1, :n) AS g"), {"tag": tag, "pub": published_at, "n": n})
        s.commit()


def where(sessions: sessionmaker[Session]) -> dict[str, int]:
    """Rows per partition."""
    with sessions() as s:
        rows = s.execute(sa.text(f"SELECT tableoid::regclass::text, count(*) FROM {TABLE} GROUP BY 1")).all()
    return {r[0]: int(r[1]) for r in rows}


def relkind(sessions: sessionmaker[Session]) -> str:
    with sessions() as s:
        return str(s.execute(sa.text(f"SELECT relkind FROM pg_class WHERE oid = '{TABLE}'::regclass")).scalar())


def publish_all(sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> int:
    published = 0
    with sessions() as s:
        while True:
            r = dispatch_batch(s, InMemoryPublisher(), clock, tables=tables, batch_size=100, max_attempts=3,
                               base_delay_ms=10, max_delay_ms=100, routes={"OrderPlaced": ("shipping",)},
                               max_message_bytes=1_000_000, namespace="t")
            published += r.published
            if r.published == 0:
                return published


def test_convert_a_live_table_then_the_relay_publishes_old_and_new_rows(
        url: str, sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> None:
    # Given a plain table with published history and pending rows
    insert(sessions, 300, published_at=1, tag="old")
    insert(sessions, 20, published_at=None, tag="pending")
    # When it is converted
    report = partitions.convert(sessions, tables=tables, size=SIZE, ahead=2)
    # Then no row moved: the old table is the first partition, new partitions are ahead
    assert relkind(sessions) == "p"
    assert where(sessions) == {f"{TABLE}_plain": 320}
    assert report.boundary == 2 * SIZE
    assert report.created == (f"{TABLE}_p2000", f"{TABLE}_p3000")
    # and `outbox db check` (readiness) accepts the layout: the parent's missing unique indexes are by design
    assert migrate.check(url) == []
    # and new rows land in the first new partition
    insert(sessions, 30, published_at=None, tag="new")
    assert where(sessions) == {f"{TABLE}_plain": 320, f"{TABLE}_p2000": 30}
    # and the relay's own queries publish every pending row, old and new
    assert publish_all(sessions, tables, clock) == 50
    with sessions() as s:
        left = s.execute(sa.text(f"SELECT count(*) FROM {TABLE} WHERE published_at_ms IS NULL")).scalar()
    assert left == 0


def test_a_reused_message_id_is_refused_in_any_partition(sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a converted table, one row in the old partition and one in a new one
    insert(sessions, 1, published_at=1, tag="old")
    partitions.convert(sessions, tables=tables, size=SIZE, ahead=2)
    insert(sessions, 1, published_at=None, tag="new")
    # When either id is written again (it would go into the newest partition)
    for tag in ("old", "new"):
        with pytest.raises(sa.exc.IntegrityError) as caught:
            insert(sessions, 1, published_at=None, tag=tag)
        # Then it is refused as the plain table's unique constraint refused it: SQLSTATE 23505
        assert is_unique_violation(caught.value)
    assert sum(where(sessions).values()) == 2


def test_without_the_reused_id_check_ids_are_unique_per_partition_only(
        sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a table converted with reused_id_check=False, one row in the old partition
    insert(sessions, 1, published_at=1, tag="old")
    partitions.convert(sessions, tables=tables, size=SIZE, ahead=2, reused_id_check=False)
    insert(sessions, 1, published_at=None, tag="new")
    # When the new partition's id is written again, it is refused (the partition's unique index)
    with pytest.raises(sa.exc.IntegrityError):
        insert(sessions, 1, published_at=None, tag="new")
    # and the old partition's id goes through: the documented trade-off
    insert(sessions, 1, published_at=None, tag="old")
    assert sum(where(sessions).values()) == 3


def test_retention_drops_expired_partitions_never_one_with_a_pending_row(
        sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> None:
    # Given a converted table: the old partition all published; then 2500 new rows over p2000, p3000,
    # p4000, all published long ago except one pending row in p3000
    insert(sessions, 100, published_at=1, tag="old")
    partitions.convert(sessions, tables=tables, size=SIZE, ahead=4)
    insert(sessions, 2500, published_at=1, tag="new")
    with sessions() as s:
        s.execute(sa.text(f"UPDATE {TABLE} SET published_at_ms = NULL WHERE seq = 3500"))
        s.commit()
    clock.set(10_000_000)
    # When retention runs with a cutoff every published row is older than
    report = retention.prune(sessions, tables=tables, inbox_older_than_ms=None, published_older_than_ms=1000,
                             clock=clock, redelivery_window_ms=1)
    # Then the old partition and p2000 are dropped (1100 rows), p3000 (pending) and p4000 (still
    # receiving rows) stay, and nothing was deleted row by row
    assert report.outbox_partitions_dropped == 2
    assert report.outbox_deleted == 1100
    assert where(sessions) == {f"{TABLE}_p3000": 1000, f"{TABLE}_p4000": 500}
    with sessions() as s:
        pending = s.execute(sa.text(f"SELECT seq FROM {TABLE} WHERE published_at_ms IS NULL")).scalars().all()
    assert pending == [3500]
    # and partitions ahead of the next seq were kept topped up
    with sessions() as s:
        names = [p.name for p in partitions.list_partitions(s, tables=tables)]
    assert f"{TABLE}_p8000" in names


def test_dead_lettered_rows_keep_their_partition_unless_a_dead_age_is_given(
        sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> None:
    # Given a closed partition whose rows are published long ago but one dead-lettered
    partitions.convert(sessions, tables=tables, size=SIZE, ahead=3)
    insert(sessions, 1500, published_at=1, tag="x")
    with sessions() as s:
        s.execute(sa.text(f"UPDATE {TABLE} SET published_at_ms = NULL, dead_lettered_at_ms = 5 WHERE seq = 2100"))
        s.commit()
    clock.set(10_000_000)
    # When expired partitions are dropped without a dead-letter age
    kept = partitions.drop_expired(sessions, tables=tables, published_older_than_ms=1000, clock=clock)
    # Then the partition with the dead row stays, saying why
    assert kept.dropped == (f"{TABLE}_plain",)  # empty old table, closed
    assert "dead-lettered" in kept.kept[f"{TABLE}_p2000"]
    # When a dead-letter age is given that the row is past
    gone = partitions.drop_expired(sessions, tables=tables, published_older_than_ms=1000, dead_older_than_ms=1000,
                                   clock=clock)
    # Then it goes
    assert gone.dropped == (f"{TABLE}_p2000",) and gone.rows == 1000


def test_ensure_and_drop_go_on_while_a_relay_batch_holds_its_transaction_open(
        sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> None:
    # Given a converted table whose old partition is all published, and a relay batch's transaction open
    # (rows claimed FOR UPDATE in the newest partition, not committed), as a pipelined relay always has
    insert(sessions, 100, published_at=1, tag="old")
    partitions.convert(sessions, tables=tables, size=SIZE, ahead=1)
    insert(sessions, 10, published_at=None, tag="new")
    relay = sessions()
    relay.execute(sa.text(f"SELECT seq FROM {TABLE} WHERE published_at_ms IS NULL FOR UPDATE SKIP LOCKED")).all()
    try:
        clock.set(10_000_000)
        # When partitions are created ahead and expired ones dropped, with a 1 s lock timeout
        created = partitions.ensure_partitions(sessions, tables=tables, ahead=3, lock_timeout_ms=1000)
        # Then both happen without waiting for the relay's transaction (no ACCESS EXCLUSIVE on the table)
        assert created == (f"{TABLE}_p3000", f"{TABLE}_p4000", f"{TABLE}_p5000")
        relay.commit()  # DETACH CONCURRENTLY waits for transactions already open: the batch ends, as batches do
        report = partitions.drop_expired(sessions, tables=tables, published_older_than_ms=1000, clock=clock,
                                         lock_timeout_ms=1000)
        assert report.dropped == (f"{TABLE}_plain",) and report.rows == 100
    finally:
        relay.close()
    assert where(sessions) == {f"{TABLE}_p2000": 10}


def test_revert_goes_back_to_the_plain_table_the_library_defines(
        url: str, sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a converted table with rows in two partitions
    insert(sessions, 10, published_at=1, tag="old")
    partitions.convert(sessions, tables=tables, size=SIZE, ahead=2)
    insert(sessions, 10, published_at=None, tag="new")
    # When it is reverted
    partitions.revert(sessions, tables=tables)
    # Then it is one plain table again with every row, the schema the library expects, unique ids enforced
    assert relkind(sessions) == "r"
    assert where(sessions) == {TABLE: 20}
    assert migrate.check(url) == []
    with pytest.raises(sa.exc.IntegrityError):
        insert(sessions, 1, published_at=None, tag="old")
    insert(sessions, 1, published_at=None, tag="after")
    with sessions() as s:
        # the seq goes on where the partitioned table left it (the refused insert above used 2010)
        assert s.execute(sa.text(f"SELECT max(seq) FROM {TABLE}")).scalar() == 2011


def test_dedup_by_key_fails_loudly_on_the_partitioned_layout(
        sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> None:
    # Given a converted table (docs/partitioning.md, "Limits")
    from celery_outbox import dedup

    partitions.convert(sessions, tables=tables, size=SIZE, ahead=1)
    values = {"message_id": uuid.uuid4(), "type": "t", "payload": {}, "headers": {}, "created_at_ms": 1,
              "next_attempt_at_ms": 1, "attempts": 0}
    # When a task row is written with a dedup key
    with sessions() as s, pytest.raises(DatabaseError, match="ON CONFLICT"):
        dedup.write_unique(s, values, key="k", on_conflict="keep", tables=tables)
    # Then nothing was written
    assert where(sessions) == {}


def test_sqlite_is_refused_and_stays_plain(sqlite_sessions: sessionmaker[Session], tables: Tables) -> None:
    with pytest.raises(ConfigError, match="needs Postgres"):
        partitions.convert(sqlite_sessions, tables=tables, size=SIZE)


def run(url: str, tmp_path: Path, *args: str) -> Result:
    sys.modules.pop("relay.app", None)  # OUTBOX_APP's relay.app reads OUTBOX_* at import (tests/integration/test_ops_cli.py)
    env = {"OUTBOX_DATABASE_URL": url, "OUTBOX_HOME": str(tmp_path), "OUTBOX_NAMESPACE": "partition-test",
           "OUTBOX_BROKER_URL": "memory://"}
    return CliRunner().invoke(cli, ["db", "partitions", *args], env=env, catch_exceptions=False)


def run_stats(url: str, tmp_path: Path) -> Result:
    sys.modules.pop("relay.app", None)
    env = {"OUTBOX_DATABASE_URL": url, "OUTBOX_HOME": str(tmp_path), "OUTBOX_NAMESPACE": "partition-test",
           "OUTBOX_BROKER_URL": "memory://"}
    return CliRunner().invoke(cli, ["stats"], env=env, catch_exceptions=False, terminal_width=200)


@pytest.mark.parametrize("args", [
    ("convert", "--size", "5"),
    ("convert", "--size", "\u0661\u0660\u0660\u0660"),
    ("convert", "--by", "day"),
    ("convert", "--lock-timeout", "soon"),
    ("drop",),
    ("drop", "--published-older-than", "-1d"),
    ("status",),  # the table is not partitioned: a configuration mismatch, said in one line
])
def test_cli_bad_input_is_one_line_exit_2_and_changes_nothing(
        url: str, sessions: sessionmaker[Session], tmp_path: Path, args: tuple[str, ...]) -> None:
    # Given a plain outbox table
    # When the command gets a bad value
    result = run(url, tmp_path, *args)
    # Then one line, exit 2, no traceback, and the table is still plain
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert relkind(sessions) == "r"


def test_cli_convert_status_and_drop(url: str, sessions: sessionmaker[Session], tmp_path: Path) -> None:
    insert(sessions, 10, published_at=1, tag="old")
    result = run(url, tmp_path, "convert", "--size", "1000", "--ahead", "2")
    assert result.exit_code == 0, result.output
    assert "exclusive lock" in result.output
    status = run(url, tmp_path, "status")
    assert status.exit_code == 0 and f"{TABLE}_plain: seq -inf..2000, 10 row(s)" in status.output, status.output
    dropped = run(url, tmp_path, "drop", "--published-older-than", "1s")
    assert dropped.exit_code == 0 and f"dropped 1 partition(s), 10 row(s): {TABLE}_plain" in dropped.output, \
        dropped.output


def test_the_notify_trigger_still_wakes_a_listening_relay_after_convert(
        url: str, sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given a converted table and a connection LISTENing on the channel the standalone relay uses
    partitions.convert(sessions, tables=tables, size=SIZE, ahead=1)
    engine = make_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as c:
            c.exec_driver_sql(f"LISTEN {tables.notify_channel}")
            raw = c.connection.dbapi_connection
            assert raw is not None
            # When a row is written through the partitioned parent
            insert(sessions, 1, published_at=None, tag="wake")
            c.exec_driver_sql("SELECT 1")  # reads the notifications the server queued
            raw.poll()
            # Then the notification arrived
            assert [n.channel for n in raw.notifies] == [tables.notify_channel]
    finally:
        engine.dispose()


def reloptions(sessions: sessionmaker[Session]) -> dict[str, list[str] | None]:
    """Each ordinary table of the outbox (the plain table, or every partition) and its storage parameters."""
    with sessions() as s:
        rows = s.execute(sa.text(
            "SELECT relname, reloptions FROM pg_class WHERE relkind = 'r' AND relname LIKE :p"),
            {"p": f"{TABLE}%"}).all()
    return {str(r[0]): r[1] for r in rows}


def test_every_partition_and_a_reverted_table_keep_the_hot_table_autovacuum_settings(
        sessions: sessionmaker[Session], tables: Tables) -> None:
    # Given the plain table as co0007 leaves it (a fixed vacuum trigger, docs/operations.md)
    assert "autovacuum_vacuum_threshold=5000" in (reloptions(sessions)[TABLE] or [])
    # When it is converted and partitions are created ahead
    partitions.convert(sessions, tables=tables, size=SIZE, ahead=2)
    partitions.ensure_partitions(sessions, tables=tables, ahead=3)
    # Then every partition (the old table included) carries the settings: the parent takes none
    parts = reloptions(sessions)
    assert len(parts) >= 3
    assert all("autovacuum_vacuum_threshold=5000" in (opts or []) for opts in parts.values()), parts
    # And a revert's new plain table carries them too
    partitions.revert(sessions, tables=tables)
    assert "autovacuum_vacuum_threshold=5000" in (reloptions(sessions)[TABLE] or [])


def test_stats_and_metrics_read_the_partitions_dead_tuples_and_the_headroom_left(
        url: str, sessions: sessionmaker[Session], tables: Tables, clock: ManualClock, tmp_path: Path) -> None:
    # Given a converted table with 2 partitions ahead of its next row
    insert(sessions, 100, published_at=1, tag="old")
    partitions.convert(sessions, tables=tables, size=SIZE, ahead=2)
    with sessions() as s:
        top = max(p.upper for p in partitions.list_partitions(s, tables=tables) if p.upper is not None)
    # When 600 rows are written and 400 of them deleted row by row (dead tuples in the partitions, none in the
    # parent, which keeps no rows), the statistics flushed
    insert(sessions, 600, published_at=1, tag="new")
    with sessions() as s:
        next_seq = int(s.execute(sa.text(f"SELECT max(seq) FROM {TABLE}")).scalar_one()) + 1
        deleted = len(s.execute(sa.text(f"DELETE FROM {TABLE} WHERE seq > :lo RETURNING seq"),
                                {"lo": next_seq - 401}).all())
        s.commit()
        s.execute(sa.text("SELECT pg_stat_force_next_flush()"))
        s.commit()
    assert deleted == 400
    # Then stats report the dead tuples summed over the partitions, and how many rows fit before writes fail
    with sessions() as s:
        st = ops_stats.collect(s, tables=tables, clock=clock)
    assert st.vacuum is not None
    [outbox] = [t for t in st.vacuum.tables if t.table == TABLE]
    assert outbox.dead_tuples >= deleted
    assert st.partitions == partitions.Headroom(rows=top - next_seq, partition_size=SIZE)
    assert st.partitions.ahead == pytest.approx((top - next_seq) / SIZE)
    assert st.to_dict()["partitions"]["rows"] == top - next_seq
    # and so does the metrics scrape (the gauges the alerts OutboxPartitionsRunningOut/Exhausted read)
    text = render(make_registry(tables=tables, session_factory=sessions, clock=clock)).decode()
    assert f"outbox_partition_headroom_rows {float(top - next_seq)}" in text
    # and `outbox stats` prints it
    result = run_stats(url, tmp_path)
    assert result.exit_code == 0, result.output
    assert f"partitions ahead: {(top - next_seq) / SIZE:.2f} ({top - next_seq} rows" in result.output


def test_the_plain_table_reports_no_headroom_and_its_own_dead_tuples(
        url: str, sessions: sessionmaker[Session], tables: Tables, clock: ManualClock) -> None:
    # Given the plain table with 50 rows deleted
    insert(sessions, 80, published_at=1, tag="plain")
    with sessions() as s:
        s.execute(sa.text(f"DELETE FROM {TABLE} WHERE seq <= 50"))
        s.commit()
        s.execute(sa.text("SELECT pg_stat_force_next_flush()"))
        s.commit()
    # When stats are read, Then there is no partition figure and the dead tuples are the table's own
    with sessions() as s:
        st = ops_stats.collect(s, tables=tables, clock=clock)
    assert st.partitions is None and st.to_dict()["partitions"] is None
    assert st.vacuum is not None
    [outbox] = [t for t in st.vacuum.tables if t.table == TABLE]
    assert outbox.dead_tuples >= 50
    assert "outbox_partitions_ahead" not in render(make_registry(tables=tables, session_factory=sessions,
                                                                 clock=clock)).decode()
