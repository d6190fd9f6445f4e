"""Loss and duplicate figures per fault: what a chaos run provoked, and what each fault cost.

Every figure is read from what the run already observes: its own counts of what it provoked, the
invariants' snapshot of the database (effects per order and consumer, the inbox's duplicate counters)
and the messages it removed in the take window. Where a figure cannot be pinned on one fault (the inbox
counts duplicates per consumer, not per cause; a missing effect does not say which kill lost it), the
row says ``None`` and the row "not attributable to one fault" carries the remainder, so each column of
figures adds up to the "all faults" total. ``affected`` does not add up: one message may meet several
faults, and it is left ``None`` where the run does not observe it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from chaos.invariants import InvariantReport

UNATTRIBUTED = "not attributable to one fault"
TOTAL = "all faults"
SUMMED = ("lost", "duplicate_deliveries", "duplicate_effects", "resent_not_lost")  # they add up to the total


class FinishedRun(Protocol):
    """What the figures read of a run (chaos/harness.py's ``ChaosReport``), so this module stays below it."""

    @property
    def invariants(self) -> InvariantReport | None: ...
    @property
    def kills(self) -> Counter[str]: ...
    @property
    def relay_mode(self) -> str: ...
    @property
    def taken_and_lost(self) -> Sequence[Any]: ...
    @property
    def take_rounds(self) -> int: ...
    @property
    def take_how(self) -> str: ...
    @property
    def beat_kills(self) -> int: ...
    @property
    def outage(self) -> str: ...
    @property
    def outage_s(self) -> float: ...
    @property
    def outage_peak_pending(self) -> int: ...
    @property
    def duplicates_injected(self) -> int: ...
    @property
    def db_freeze_s(self) -> float: ...
    @property
    def db_freeze_connections(self) -> int: ...
    @property
    def consumers_stop_s(self) -> float: ...
    @property
    def consumers_stop_peak_queued(self) -> int: ...
    @property
    def resent(self) -> Sequence[Any]: ...
    @property
    def resent_not_lost(self) -> Sequence[Any]: ...


@dataclass(frozen=True, kw_only=True)
class FaultFigures:
    """One fault kind's row: ``None`` where the run cannot attribute the figure to this fault."""

    fault: str
    provoked: int
    affected: int | None
    lost: int | None
    duplicate_deliveries: int | None
    duplicate_effects: int | None
    resent_not_lost: int | None = None  # messages the reconciler published again that were late, not lost
    notes: str = ""


def _kill_row(fault: str, times: int, what: str) -> FaultFigures:
    return FaultFigures(fault=fault, provoked=times, affected=None, lost=None, duplicate_deliveries=None,
                        duplicate_effects=None, resent_not_lost=None,
                        notes=f"{what}; which messages a SIGKILL held is not recorded per kill: its losses and "
                              "duplicates are in the unattributable row")


def fault_figures(r: FinishedRun) -> list[FaultFigures]:
    """The per-fault table of a finished run (``r.invariants`` set), its last two rows the unattributable
    remainder and the totals."""
    assert r.invariants is not None
    snap = r.invariants.snapshot
    k = r.kills
    relay_kills = k["after_claim_before_publish"] + k["after_publish_before_mark"] + k["after_mark"]
    rows = [
        _kill_row("hard kill: order writer", k["after_order_commit"],
                  "SIGKILL right after an order's commit (its event and e-mail task already in the outbox)"),
        _kill_row("hard kill: relay", relay_kills,
                  "SIGKILL after claim / after publish / after mark "
                  f"({k['after_claim_before_publish']}/{k['after_publish_before_mark']}/{k['after_mark']})"
                  + (", relay-queue workers under beat" if r.relay_mode == "beat" else "")),
        _kill_row("hard kill: worker", k["consumer_before_commit"] + k["consumer_after_commit_before_ack"],
                  "SIGKILL before the consumer's commit / after it, before the ack "
                  f"({k['consumer_before_commit']}/{k['consumer_after_commit_before_ack']})"),
    ]
    if r.relay_mode == "beat":
        rows.append(_kill_row("hard kill: beat", r.beat_kills, "SIGKILL of `celery beat`, back 0.2-2 s later"))
    rows.append(FaultFigures(
        fault="broker outage", provoked=1 if r.outage_s else 0, affected=r.outage_peak_pending, lost=None,
        duplicate_deliveries=None, duplicate_effects=None,
        notes=f"{r.outage}, {r.outage_s:.1f} s; affected: outbox rows held back (peak pending during the "
              "outage); what it cost is in the unattributable row"))
    if r.db_freeze_s:
        rows.append(FaultFigures(
            fault="database freeze", provoked=1, affected=r.db_freeze_connections, lost=None,
            duplicate_deliveries=None, duplicate_effects=None,
            notes=f"every process's connections to Postgres stalled {r.db_freeze_s:.1f} s (loopback proxy, "
                  "nothing forwarded, nothing closed); affected: connections open or opened during the freeze"))
    if r.consumers_stop_s:
        rows.append(FaultFigures(
            fault="consumers stopped", provoked=1, affected=r.consumers_stop_peak_queued, lost=None,
            duplicate_deliveries=None, duplicate_effects=None,
            notes=f"every consumer worker stopped (SIGSTOP, connections kept) {r.consumers_stop_s:.0f} s while orders "
                  "kept coming; affected: the most messages their queues held meanwhile"))
    lost_in_take = r.invariants.lost_never_recorded
    rows.append(FaultFigures(
        fault="take-window loss", provoked=r.take_rounds, affected=len(r.taken_and_lost), lost=lost_in_take,
        duplicate_deliveries=None, duplicate_effects=None, resent_not_lost=0,
        notes=f"{r.take_how}; affected: messages removed from the broker; lost: those never recorded after "
              f"all (the reconciler re-sent {snap.reconciled} message(s) in the whole run, "
              f"{len(r.resent) - len(r.resent_not_lost)} of them removed here)"))
    rows.append(FaultFigures(
        fault="duplicates injected", provoked=1 if r.duplicates_injected else 0, affected=r.duplicates_injected,
        lost=0, duplicate_deliveries=r.duplicates_injected, duplicate_effects=None, resent_not_lost=0,
        notes="rows re-published and one event sent twice at once; each extra copy is one duplicate delivery "
              "(the invariant checks the inbox counted at least as many)"))
    total = FaultFigures(
        fault=TOTAL, provoked=sum(row.provoked for row in rows), affected=None,
        lost=snap.missing_effects, duplicate_deliveries=snap.duplicates_absorbed,
        duplicate_effects=snap.extra_effects, resent_not_lost=len(r.resent_not_lost),
        notes=f"{snap.committed_orders} committed orders x {len(snap.effects)} deliveries; lost: "
              "(order, consumer or e-mail) pairs with no effect at the end; duplicate deliveries: the inbox's "
              "counters; duplicate effects: effects beyond the first (must be 0); re-sent, not lost: the "
              "reconciler's re-sends of messages the run did not remove from the broker (must be 0)")

    def rest(column: str) -> int:
        attributed = sum(getattr(row, column) or 0 for row in rows)
        return int(getattr(total, column)) - attributed

    rows.append(FaultFigures(
        fault=UNATTRIBUTED, provoked=0, affected=None, lost=rest("lost"),
        duplicate_deliveries=rest("duplicate_deliveries"), duplicate_effects=rest("duplicate_effects"),
        resent_not_lost=rest("resent_not_lost"),
        notes="the rest of each total: kills, the outage, the second relay, redeliveries and re-sends all "
              "cause duplicate deliveries the inbox counts without their cause"))
    rows.append(total)
    return rows


def to_json(rows: Sequence[FaultFigures]) -> list[dict[str, Any]]:
    return [asdict(row) for row in rows]


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)


def to_markdown(rows: Sequence[FaultFigures], *, title: str, command: str) -> str:
    """The table as markdown, with the command that produced it and the caveat about the machine."""
    lines = [f"### {title}", "", f"`{command}`", "",
             "| fault | provoked | messages affected | messages lost | duplicate deliveries | duplicate effects "
             "| re-sent, not lost | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        name = f"**{row.fault}**" if row.fault == TOTAL else row.fault
        lines.append(f"| {name} | {row.provoked} | {_cell(row.affected)} | {_cell(row.lost)} | "
                     f"{_cell(row.duplicate_deliveries)} | {_cell(row.duplicate_effects)} | "
                     f"{_cell(row.resent_not_lost)} | {row.notes.replace('|', '/')} |")
    lines += ["", "`-`: not observed for this fault alone (see the notes). Lost, duplicate deliveries, duplicate "
              "effects and re-sent-not-lost add up to the totals; messages affected do not (one message can meet "
              "several faults)."]
    return "\n".join(lines) + "\n"


def render(rows: Sequence[FaultFigures], *, title: str) -> object:
    """The table for a terminal, as a rich Table (imported lazily: only the CLI needs rich)."""
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    for name in ("fault", "provoked", "affected", "lost", "duplicate deliveries", "duplicate effects",
                 "re-sent, not lost"):
        table.add_column(name, justify="left" if name == "fault" else "right")
    table.add_column("notes")
    for row in rows:
        table.add_row(row.fault, str(row.provoked), _cell(row.affected), _cell(row.lost),
                      _cell(row.duplicate_deliveries), _cell(row.duplicate_effects), _cell(row.resent_not_lost),
                      row.notes)
    return table
