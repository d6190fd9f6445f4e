"""The ``outbox chaos`` run itself, short, on both brokers and with beat driving the relay, with its loss
and duplicate figures per fault; and proof that its checks can fail (a lost confirmation e-mail included)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from chaos import figures, invariants
from chaos.environment import ChaosEnvironment
from chaos.harness import ChaosReport, plan_kills, plan_takes, run_chaos
from chaos.load import make_plan as plan
from consumers.models import SentEmail, Shipment
from devtools.__main__ import cli
from devtools.cli_chaos import report_json

pytestmark = [pytest.mark.chaos, pytest.mark.postgres, pytest.mark.workers, pytest.mark.slow]


@pytest.mark.parametrize(("broker", "relay"), [("redis", "standalone"), ("rabbitmq", "standalone"),
                                               ("redis", "beat")])
def test_short_chaos_run_holds_every_invariant(broker: str, relay: str, tmp_path: Path,
                                               require: Callable[[str, str, int], None]) -> None:
    require("PostgreSQL", "127.0.0.1", 5432)
    if broker == "rabbitmq":
        require("RabbitMQ", "127.0.0.1", 5672)
    # Given/When: 40 orders, 6 SIGKILLs at crash points, one broker outage, a 3 s database freeze,
    # poison and duplicates, one
    # confirmation e-mail task and one event lost in the take window after their rows were marked
    # published; with beat, the relay runs as beat's tasks and beat is SIGKILLed twice
    # (RabbitMQ: the workers prefetch one per thread, so the take window finds ready messages: 40 orders fit in
    # the deployment's prefetch windows, which a frozen worker keeps holding; run_chaos's docstring)
    report = run_chaos(orders=40, kills=6, broker=broker, seed=7, workdir=tmp_path / "run", timeout_s=150,
                       relay=relay, prefetch_multiplier=1 if broker == "rabbitmq" else None,
                       progress=print)  # what it did, shown when the test fails
    # Then: every invariant holds (each lost message recorded once after all, one e-mail per committed
    # order, none for a rolled-back one) and the provocations really happened
    assert report.invariants is not None
    assert report.ok, (report.invariants.violations, report.unexpected_exits)
    assert sum(report.kills.values()) >= 3, (report.kills, report.armed_not_reached)
    assert report.outage_s > 0 and report.second_relay_s > 0
    assert report.db_freeze_s >= 3.0 and report.db_freeze_connections > 0
    assert report.invariants.snapshot.dead_letters == report.poison == 2
    assert report.invariants.snapshot.duplicates_absorbed >= report.duplicates_injected > 0
    # and the search consumer ran as the deployment's batch consumer, its batches counted and reported
    snap = report.invariants.snapshot
    assert snap.batched_messages["search"] >= snap.batches["search"] > 0
    assert report_json(report)["batches"]["search"] == {"batches": snap.batches["search"],
                                                        "messages": snap.batched_messages["search"]}
    lost = [m.delivery for m in report.taken_and_lost]
    event = set(lost) - {invariants.EMAIL}  # the e-mail task and one consumer's event, in either order
    assert len(lost) == len(set(lost)) == 2 and len(event) == 1 and event <= set(report.invariants.snapshot.inbox_rows)
    # and the reconciler re-sent what had no other copy. Not per kind: a lost message of which the broker held a
    # second copy (a relay SIGKILLed between publish and mark publishes its batch again; a publish whose confirm
    # the broker outage cut is sent again) comes back through that copy first, and the reconciler, finding its
    # inbox row, rightly sends nothing; a run where one of the two had such a copy is green.
    assert report.invariants.snapshot.reconciled_tasks + report.invariants.snapshot.reconciled_events >= 1
    assert report.invariants.snapshot.effects[invariants.EMAIL] == report.invariants.snapshot.committed_orders
    assert report.beat_kills == report.beat_kills_planned == (2 if relay == "beat" else 0)
    rows = {row.failure: row for row in report.matrix}
    assert len(rows) == (14 if relay == "beat" else 13) and all(row.ok for row in report.matrix)
    # and nothing that was only late (behind the outage or the freeze) was re-sent
    assert report.resent_not_lost == [] and rows["consumers behind (freeze, outage, stopped consumers)"].ok
    assert rows["worker killed between taking a message and recording it"].times == 2
    # and the per-fault figures are written, as JSON and markdown, and add up
    assert_fault_figures(report, tmp_path / "figures.md")


def markdown_rows(text: str) -> dict[str, list[str]]:
    """fault -> its cells (provoked .. re-sent, not lost), read back from the markdown table."""
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
             if line.startswith("| ") and not line.startswith("| fault")]
    return {c[0].strip("*"): c[1:7] for c in cells}


def assert_fault_figures(report: ChaosReport, path: Path) -> None:
    assert report.invariants is not None
    by_fault = {row.fault: row for row in report.figures}
    kinds = {"hard kill: order writer", "hard kill: relay", "hard kill: worker", "broker outage",
             "database freeze", "take-window loss", "duplicates injected", figures.UNATTRIBUTED, figures.TOTAL}
    assert set(by_fault) == kinds | ({"hard kill: beat"} if report.relay_mode == "beat" else set())
    total = by_fault[figures.TOTAL]
    parts = [row for row in report.figures if row.fault != figures.TOTAL]
    for column in figures.SUMMED:  # every figure is attributed to one row, the remainder included
        assert sum(getattr(row, column) or 0 for row in parts) == getattr(total, column), column
    assert all(getattr(row, column) is None or getattr(row, column) >= 0 for row in report.figures
               for column in figures.SUMMED)
    assert total.provoked == sum(row.provoked for row in parts)
    kills = sum(by_fault[f].provoked for f in ("hard kill: order writer", "hard kill: relay", "hard kill: worker"))
    assert kills == sum(report.kills.values())
    assert total.lost == 0 and total.duplicate_effects == 0 and total.resent_not_lost == 0  # it held its invariants
    assert total.duplicate_deliveries == report.invariants.snapshot.duplicates_absorbed
    take = by_fault["take-window loss"]
    assert (take.affected, take.lost) == (len(report.taken_and_lost), 0)
    assert by_fault["database freeze"].affected == report.db_freeze_connections
    assert by_fault["duplicates injected"].duplicate_deliveries == report.duplicates_injected
    # the --json report carries them, and --markdown writes them with the command
    assert report_json(report)["figures"] == figures.to_json(report.figures)
    path.write_text(figures.to_markdown(report.figures, title="short run", command="python -m devtools chaos"))
    table = markdown_rows(path.read_text())
    assert list(table) == [row.fault for row in report.figures]
    for i, column in enumerate(("provoked", "affected", "lost", "duplicate_deliveries", "duplicate_effects",
                                "resent_not_lost")):
        assert [r[i] for r in table.values()] == [
            "-" if getattr(row, column) is None else str(getattr(row, column)) for row in report.figures]


def test_fault_figures_attribute_what_they_can_and_leave_the_rest_unattributed() -> None:
    from collections import Counter

    from chaos.harness import LostMessage

    # Given: a run that lost two messages in the take window, one never recorded, and whose database
    # shows 3 effects missing, 1 effect doubled and 10 duplicate deliveries (4 of them injected)
    snap = invariants.Snapshot(committed_orders=5, missing_effects=3, extra_effects=1, duplicates_absorbed=10,
                               effects={"shipping": 5, invariants.EMAIL: 4})
    report = ChaosReport(broker="redis", seed=1, orders=5, kills_requested=3, duplicates_injected=4, take_rounds=1,
                         kills=Counter({"after_mark": 1, "consumer_before_commit": 2}), outage_s=1.0,
                         taken_and_lost=[LostMessage(delivery=invariants.EMAIL, message_id="a"),
                                         LostMessage(delivery="shipping", message_id="b")],
                         resent=[LostMessage(delivery=invariants.EMAIL, message_id="a"),
                                 LostMessage(delivery="billing", message_id="b")],
                         invariants=invariants.InvariantReport(snapshot=snap, lost_never_recorded=1))
    # When: the figures are built
    rows = {row.fault: row for row in figures.fault_figures(report)}
    # Then: the take window's loss is its own, the rest of each total is unattributed, nothing invented
    assert (rows["take-window loss"].affected, rows["take-window loss"].lost) == (2, 1)
    rest, total = rows[figures.UNATTRIBUTED], rows[figures.TOTAL]
    assert (rest.lost, rest.duplicate_deliveries, rest.duplicate_effects) == (2, 6, 1)
    assert (total.lost, total.duplicate_deliveries, total.duplicate_effects) == (3, 10, 1)
    # and a re-send of a message the run never removed (b to billing: only shipping lost it) is late, not lost
    assert (rows["take-window loss"].resent_not_lost, rest.resent_not_lost, total.resent_not_lost) == (0, 1, 1)
    assert rows["hard kill: worker"].provoked == 2 and rows["hard kill: worker"].lost is None
    assert "database freeze" not in rows and "hard kill: beat" not in rows  # not provoked in this run
    table = markdown_rows(figures.to_markdown(list(rows.values()), title="t", command="c"))
    assert table["hard kill: relay"] == ["1", "-", "-", "-", "-", "-"]


def test_kill_plan_is_reproducible_and_covers_every_crash_point() -> None:
    import random

    a = plan_kills(12, random.Random(3))
    b = plan_kills(12, random.Random(3))
    assert a == b
    points = {spec.partition("@")[0] for q in a.values() for spec in q}
    assert points == {"after_order_commit", "after_claim_before_publish", "after_publish_before_mark",
                      "after_mark", "consumer_before_commit", "consumer_after_commit_before_ack"}


def test_take_window_rounds_come_before_and_after_the_outage() -> None:
    import random

    assert plan_takes(1, random.Random(1))[0] < 0.5
    fracs = plan_takes(4, random.Random(1))
    assert fracs == sorted(fracs) and sum(f < 0.5 for f in fracs) == 2 and all(0.1 <= f < 0.9 for f in fracs)


def test_invariants_catch_an_email_lost_in_the_take_window(redis_chaos: ChaosEnvironment) -> None:
    env = redis_chaos
    # Given: two orders relayed (no worker yet), then one confirmation e-mail task removed from the
    # Redis list after its row was marked published, as a worker SIGKILLed between BRPOP and its
    # unacked record leaves it; and an e-mail recorded by the provider for no order at all
    loader = env.orders(plan(2))
    loader.start()
    assert loader.wait_exit(timeout_s=60) == 0, env.logs()
    relay = env.relay()
    relay.start()
    env.wait(lambda: env.pending() == 0, what="both orders relayed")
    relay.stop()  # no reconciler from here on: the loss stays a loss
    taken = env.take_and_lose(invariants.EMAIL)
    assert taken is not None
    assert env.count(env.tables.outbox, env.tables.outbox.published_at_ms.is_(None)) == 0
    env.worker().start()

    def handled() -> bool:
        with env.sessions() as s:
            rows = s.execute(sa.select(sa.func.count()).select_from(env.tables.inbox)).scalar_one()
        return env.pending() == 0 and rows == 2 * len(env.consumers) + 1

    env.wait(handled, what="everything but the lost e-mail handled")
    with env.sessions() as s:
        s.add(SentEmail(idempotency_key=f"{invariants.CONFIRMATION}:00000000-0000-4000-8000-000000000000",
                        to="x@example.com", subject="for no order", sent_at_ms=0))
        s.commit()
        # When: the invariants are checked, told what was lost
        report = invariants.check(s, tables=env.tables, consumers=env.consumers, rolled_back=[], poison=[],
                                  lost=[(invariants.CONFIRMATION_KEY, taken.message_id)])
    # Then: the e-mail path's invariants and the take-window one fail; the consumers' hold
    names = {v.invariant for v in report.violations}
    assert names == {"email: every order seen once", "email: exactly one effect per order",
                     "email: no effect without a committed order", "taken and lost: re-sent and recorded"}


def test_invariants_catch_lost_and_doubled_effects(redis_chaos: ChaosEnvironment) -> None:
    env = redis_chaos
    # Given: orders committed but never relayed, and one order's shipment written twice by hand
    loader = env.orders(plan(3))
    loader.start()
    assert loader.wait_exit(timeout_s=60) == 0, env.logs()
    with env.sessions() as s:
        payload = s.execute(sa.select(env.tables.outbox.payload)
                            .where(env.tables.outbox.type == invariants.ORDER_PLACED)).scalars().first()
        assert payload is not None
        order_id = payload["order_id"]
        for _ in range(2):
            s.add(Shipment(order_id=order_id, address_line="", items=1, created_at_ms=0))
        s.commit()
        # When: the invariants are checked
        report = invariants.check(s, tables=env.tables, consumers=env.consumers, rolled_back=[],
                                  poison=[("billing", "x")])
    # Then: each broken rule is reported
    names = {v.invariant for v in report.violations}
    assert not report.ok
    assert "relay drained" in names
    assert "shipping: exactly one effect per order" in names
    assert "billing: every order seen once" in names
    assert "email: every order seen once" in names  # the confirmation e-mail task never ran
    assert "email: exactly one effect per order" in names  # ... so no order got its e-mail
    assert "dead letters are exactly the poison" in names
    # and the per-fault figures' totals count them: 3 orders x 4 deliveries, but for the doubled shipment
    assert (report.snapshot.missing_effects, report.snapshot.extra_effects) == (3 * 4 - 1, 1)


def test_cli_rejects_an_unknown_broker() -> None:
    result = CliRunner().invoke(cli, ["chaos", "--broker", "kafka"])
    assert result.exit_code == 2
    assert "kafka" in result.output


def test_cli_refuses_a_markdown_path_it_cannot_write_before_running(tmp_path: Path) -> None:
    # Given: a --markdown path under a regular file (no directory can be made there)
    blocker = tmp_path / "file"
    blocker.write_text("")
    # When: the run is asked for
    result = CliRunner().invoke(cli, ["chaos", "--markdown", str(blocker / "figures.md")])
    # Then: one line and exit 1, before any database or process is started
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert "database" not in result.output
