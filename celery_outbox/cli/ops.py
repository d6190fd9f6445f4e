"""``outbox dead-letters ...``, ``outbox prune``, ``outbox stats``: the on-call person's commands.

Human output is rich tables; ``--json`` is for machines (one JSON document on stdout). Bad ids,
unknown consumers and bad durations exit non-zero with the reason and change nothing. Prune and
replay show progress as they go (``celery_outbox.cli.progress``) and end with a summary. ``stats``
thresholds exit 3 when crossed (exit codes: ``celery_outbox.cli.probes``).

One module, though long: the three commands share the on-call output (ages, rich tables, --json, progress
lines) and the same refusals of bad input; split, each part would import the same helpers back.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text
from sqlalchemy.orm import Session, sessionmaker

from celery_outbox.cli.common import (
    AsciiInt,
    AsciiSeconds,
    BadInput,
    Checked,
    Duration,
    SafeConsole,
    echo_json,
    get_outbox,
    get_settings,
    handle_errors,
    one_line,
    printable,
)
from celery_outbox.cli.probes import EXIT_PROBLEM
from celery_outbox.cli.progress import ProgressView
from celery_outbox.clock import SystemClock
from celery_outbox.errors import ArchiveError, NotFoundError, ValidationError
from celery_outbox.ops import dead_letter_groups as groups_mod
from celery_outbox.ops import dead_letters as dl
from celery_outbox.ops import retention
from celery_outbox.ops import stats as ops_stats
from celery_outbox.outbox import Outbox

DEAD_LETTER_ID = Checked(name="dead_letter_id", check=dl.DeadLetterId.parse)
GROUP_ID = Checked(name="group_id", check=groups_mod.check_group_id)


def _sessions(ctx: click.Context) -> sessionmaker[Session]:
    return get_outbox(ctx).sessions()


def _check_consumer(outbox: Outbox, consumer: str | None) -> None:
    """``--consumer`` names one of the app's consumers: another name is a bad option (exit 2), refused before the
    database, like a typo in any other option; a typo must not look like 'no dead letters' either."""
    try:
        dl.check_consumer(consumer, outbox.known_consumers())
    except NotFoundError as e:
        raise BadInput(f"Invalid value for '--consumer': {one_line(str(e))}") from None


def _console() -> Console:
    """Tables for humans; piped output gets a wide fixed width so nothing is wrapped mid-word."""
    return SafeConsole(width=None if sys.stdout.isatty() else 200)


def _age(ms: int | None) -> str:
    if ms is None:
        return "-"
    s = ms // 1000
    d, h, m = s // 86400, s % 86400 // 3600, s % 3600 // 60
    return f"{d}d {h}h" if d else f"{h}h {m}m" if h else f"{m}m {s % 60}s" if m else f"{s}s"


def _utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _table(title: str, columns: tuple[str, ...]) -> Table:
    """A rich table with these column headings (every human listing of these commands is one)."""
    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    return table


@click.group("dead-letters")
def dead_letters() -> None:
    """List, inspect, replay and purge dead letters (outbox:<seq> and consumer:<id>)."""


@dead_letters.command("list")
@click.option("--source", type=click.Choice(dl.SOURCES), default=None, help="Only this store.")
@click.option("--consumer", default=None, help="Only this consumer's dead letters.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@handle_errors
def list_cmd(ctx: click.Context, source: dl.Source | None, consumer: str | None, as_json: bool) -> None:
    """Unreplayed dead letters, oldest first."""
    outbox = get_outbox(ctx)
    _check_consumer(outbox, consumer)
    now = SystemClock().now_ms()
    with _sessions(ctx)() as session:
        items = dl.list_dead_letters(session, tables=outbox.tables, source=source, consumer=consumer,
                                     known_consumers=outbox.known_consumers())
    if as_json:
        echo_json([d.to_dict(now_ms=now) for d in items])
        return
    if not items:
        click.echo("no dead letters")
        return
    table = _table(f"{len(items)} dead letter(s)", ("id", "age", "source", "consumer", "type", "attempts", "error"))
    for d in items:
        table.add_row(str(d.id), _age(d.age_ms(now)), d.source, d.consumer or "-", d.type or "?",
                      str(d.attempts), d.error[:100])
    _console().print(table)


@dead_letters.command("show")
@click.argument("dl_id", type=DEAD_LETTER_ID)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@handle_errors
def show_cmd(ctx: click.Context, dl_id: str, as_json: bool) -> None:
    """One dead letter with its error, payload and headers."""
    outbox = get_outbox(ctx)
    now = SystemClock().now_ms()
    with _sessions(ctx)() as session:
        d = dl.get(session, dl_id, tables=outbox.tables)
    data = d.to_dict(now_ms=now)
    if as_json:
        echo_json(data)
        return
    table = Table(show_header=False, title=f"dead letter {d.id}")
    table.add_column("field")
    table.add_column("value")
    for key in ("source", "consumer", "message_id", "task_id", "type", "attempts", "replayed_at_ms"):
        table.add_row(key, str(data[key] if data[key] is not None else "-"))
    table.add_row("age", _age(data["age_ms"]))
    console = _console()
    console.print(table)
    console.print(Text("error", style="bold"))
    console.print(d.error)
    console.print(Text("payload", style="bold"))
    console.print(json.dumps(d.payload, indent=2, sort_keys=True, default=str))
    console.print(Text("headers", style="bold"))
    console.print(json.dumps(d.headers, indent=2, sort_keys=True, default=str))


@dead_letters.command("replay")
@click.argument("ids", nargs=-1, type=DEAD_LETTER_ID)
@click.option("--all", "replay_all", is_flag=True, help="Replay every unreplayed dead letter.")
@click.option("--consumer", default=None, help="With --all: only this consumer's dead letters.")
@click.option("--group", "group", type=GROUP_ID, default=None, help="Replay one group (see 'outbox dead-letters groups').")
@click.option("--dry-run", is_flag=True, help="With --group: say what would be sent where; change nothing.")
@click.option("--rate", type=AsciiSeconds(low=0.001), default=groups_mod.DEFAULT_REPLAY_RATE, show_default=True,
              help="With --group: at most this many dead letters a second.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@handle_errors
def replay_cmd(ctx: click.Context, ids: tuple[str, ...], replay_all: bool, consumer: str | None, group: str | None,
               dry_run: bool, rate: float, as_json: bool) -> None:
    """Replay dead letters: outbox rows go back to the relay due now; consumer rows are re-sent to
    their consumer's queue. Replaying twice has one effect (the inbox guards it). A --group replay is
    throttled and resumable: run it again after a crash and it carries on where it stopped."""
    if sum((bool(ids), replay_all, group is not None)) != 1:
        raise click.UsageError("give dead-letter ids or --all or --group (exactly one)")
    if consumer is not None and not replay_all:
        raise click.UsageError("--consumer goes with --all")
    if dry_run and group is None:
        raise click.UsageError("--dry-run goes with --group")
    if group is not None:
        _replay_group(ctx, groups_mod.check_group_id(group), dry_run=dry_run, rate=rate, as_json=as_json)
        return
    outbox = get_outbox(ctx)
    _check_consumer(outbox, consumer)
    clock = SystemClock()
    with _sessions(ctx)() as session:
        if replay_all:
            refs = [d.id for d in dl.list_dead_letters(session, tables=outbox.tables, consumer=consumer,
                                                       known_consumers=outbox.known_consumers())]
        else:
            refs = dl.parse_ids(ids)
        needs_broker = any(r.source == "consumer" for r in refs)
        if needs_broker:
            from celery_outbox.celery.sender import replay_sender

            outbox.broker_url()  # asked first: a broker the app only finds on demand is found (or refused) here

            send: dl.Sender | None = replay_sender(outbox.app, outbox)
        else:
            send = None
        with ProgressView(machine=as_json) as view:
            view.start("replay", "replaying dead letters", len(refs))

            def step(p: dl.ReplayProgress) -> None:
                r = p.result
                view.update("replay", p.done, p.total, keep=True,
                            line=f"[{p.done}/{p.total}] {r.id}: {'replayed' if r.replayed else 'skipped'}: {r.detail}")

            results = dl.replay(session, refs, tables=outbox.tables, clock=clock, send=send,
                                known_consumers=outbox.known_consumers(), progress=step) \
                if refs else []
    if as_json:
        echo_json([{"id": str(r.id), "replayed": r.replayed, "detail": r.detail} for r in results])
        return
    if not results:
        click.echo("nothing to replay")
        return
    replayed = sum(r.replayed for r in results)
    click.echo(f"summary: {replayed} replayed, {len(results) - replayed} skipped, of {len(results)} dead letter(s)")


@dead_letters.command("purge")
@click.argument("ids", nargs=-1, type=DEAD_LETTER_ID)
@click.option("--group", "group", type=GROUP_ID, default=None, help="Purge one group (see 'outbox dead-letters groups').")
@click.option("--archive", default=None, metavar="FILE",
              help="With --group: append each dead letter to this JSON-lines file before deleting it.")
@click.option("--rate", type=AsciiSeconds(low=0.001), default=groups_mod.DEFAULT_PURGE_RATE, show_default=True,
              help="With --group: at most this many deletions a second.")
@click.option("--json", "as_json", is_flag=True, help="With --group: machine-readable output.")
@click.option("--yes", is_flag=True, help="Confirm: the dead letters are deleted for good.")
@click.pass_context
@handle_errors
def purge_cmd(ctx: click.Context, ids: tuple[str, ...], group: str | None, archive: str | None, rate: float,
              as_json: bool, yes: bool) -> None:
    """Delete dead letters for good (needs --yes); --group --archive FILE keeps a copy first."""
    if bool(ids) == (group is not None):
        raise click.UsageError("give dead-letter ids or --group (one of them)")
    if group is None and archive is not None:
        raise click.UsageError("--archive goes with --group")
    if group is not None:
        gid = groups_mod.check_group_id(group)
        if not yes:
            raise click.UsageError("purge deletes for good; add --yes to confirm")
        _purge_group(ctx, gid, archive=archive, rate=rate, as_json=as_json)
        return
    refs = dl.parse_ids(ids)
    if not yes:
        raise click.UsageError("purge deletes for good; add --yes to confirm")
    outbox = get_outbox(ctx)
    with _sessions(ctx)() as session:
        n = dl.purge(session, refs, tables=outbox.tables)
    click.echo(f"purged {n} dead letter(s)")


@dead_letters.command("groups")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@handle_errors
def groups_cmd(ctx: click.Context, as_json: bool) -> None:
    """Unreplayed dead letters grouped by failure (consumer or task, exception type, normalised
    message), largest first, with first and last seen and a sample."""
    outbox = get_outbox(ctx)
    now = SystemClock().now_ms()
    with _sessions(ctx)() as session:
        found = groups_mod.list_groups(session, tables=outbox.tables)
    if as_json:
        echo_json([g.to_dict() for g in found])
        return
    if not found:
        click.echo("no dead letters")
        return
    table = _table(f"{len(found)} group(s), {sum(g.count for g in found)} dead letter(s)",
                   ("group", "count", "consumer", "error", "first seen", "last seen", "sample"))
    for g in found:
        error = f"{g.error_class}: {g.message}" if g.error_class else g.message
        table.add_row(g.id, str(g.count), g.consumer, error[:100], _age(now - g.first_seen_ms) + " ago",
                      _age(now - g.last_seen_ms) + " ago", g.sample_id)
    _console().print(table)


def _run_summary(report: groups_mod.RunReport) -> str:
    verb = "replayed" if report.action == "replay" else "purged"
    text = f"summary: group {report.group}: {report.done_now} {verb}"
    if report.done_before:
        text += f" now, {report.done_before} by the earlier run that stopped (resumed)"
    text += f"; {report.done_before + report.done_now} of {report.total}"
    if report.skipped:
        text += f", {report.skipped} skipped (cannot be replayed: see the lines above)"
    if report.archived_to:
        text += f"; archived to {report.archived_to}"
    return printable(text)  # the archive's path as given: a file name need not be text a terminal can take


def _replay_group(ctx: click.Context, gid: str, *, dry_run: bool, rate: float, as_json: bool) -> None:
    outbox = get_outbox(ctx)
    with _sessions(ctx)() as session:
        group = groups_mod.get_group(session, gid, tables=outbox.tables)
    send: dl.Sender | None = None
    if group.source == "consumer" and not dry_run:
        from celery_outbox.celery.sender import replay_sender

        outbox.broker_url()
        send = replay_sender(outbox.app, outbox)
    with ProgressView(machine=as_json) as view:
        view.start("group", f"{'dry run of ' if dry_run else ''}replaying group {gid}", group.count)

        def step(p: groups_mod.RunProgress) -> None:
            skipped = "skipped" in p.line  # the one per-item line worth reading back; the rest is the bar
            view.update("group", p.done, p.total, line=p.line if skipped else None, keep=skipped)

        report = groups_mod.replay_group(_sessions(ctx), gid, tables=outbox.tables, clock=SystemClock(), send=send,
                                         known_consumers=outbox.known_consumers(), dry_run=dry_run, rate=rate,
                                         progress=step)
    if as_json:
        echo_json(report.to_dict())
        return
    if dry_run:
        plan = ", ".join(f"{n} to {where}" for where, n in sorted((report.plan or {}).items())) or "nothing"
        click.echo(printable(f"dry run: group {gid} would send {plan}; {report.skipped} cannot be replayed; "
                             "nothing was changed"))
        return
    click.echo(_run_summary(report))


def _purge_group(ctx: click.Context, gid: str, *, archive: str | None, rate: float, as_json: bool) -> None:
    outbox = get_outbox(ctx)
    with _sessions(ctx)() as session:
        group = groups_mod.get_group(session, gid, tables=outbox.tables)
    with ProgressView(machine=as_json) as view:
        view.start("group", f"purging group {gid}", group.count)

        def step(p: groups_mod.RunProgress) -> None:
            view.update("group", p.done, p.total)

        try:
            report = groups_mod.purge_group(_sessions(ctx), gid, tables=outbox.tables, clock=SystemClock(),
                                            archive=archive, rate=rate, progress=step)
        except ArchiveError as e:  # the file cannot keep them: a bad argument (or a full disk), exit 2
            raise BadInput(one_line(str(e))) from None
    if as_json:
        echo_json(report.to_dict())
        return
    click.echo(_run_summary(report))


@click.command("prune")
@click.option("--inbox-older-than", type=Duration(), default=None,
              help="Delete inbox rows processed longer ago than this (>= the broker redelivery window).")
@click.option("--published-older-than", type=Duration(), default=None,
              help="Delete published outbox rows published longer ago than this.")
@click.option("--batch", type=AsciiInt(low=1), default=retention.DEFAULT_BATCH, show_default=True,
              help="Rows per DELETE (one short transaction each).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@handle_errors
def prune(ctx: click.Context, inbox_older_than: int | None, published_older_than: int | None, batch: int,
          as_json: bool) -> None:
    """Retention: prune old inbox rows and published outbox rows in batches."""
    if inbox_older_than is None and published_older_than is None:
        raise click.UsageError("give --inbox-older-than and/or --published-older-than")
    settings = get_settings(ctx)
    if inbox_older_than is not None:
        try:  # a value the settings forbid is a bad flag (exit 2, docs/operations.md "Probes and exit codes")
            retention.check_inbox_retention(inbox_older_than, settings.broker_redelivery_window_ms)
        except ValidationError as e:
            raise BadInput(f"--inbox-older-than: {one_line(str(e))}") from None
    names = {"inbox": "inbox", "outbox": "published outbox rows"}
    started = time.monotonic()
    with ProgressView(machine=as_json) as view:

        def step(p: retention.PruneProgress) -> None:
            what = names[p.target]
            if p.batch == 0:
                view.start(p.target, f"pruning {what}", p.expected,
                           line=f"{p.target}: {p.expected} row(s) to delete, in batches of {batch}")
            else:
                view.update(p.target, p.total_deleted, p.expected,
                            line=f"{p.target}: batch {p.batch}: deleted {p.deleted} ({p.total_deleted}/{p.expected})")

        report = retention.prune(_sessions(ctx), tables=get_outbox(ctx).tables, inbox_older_than_ms=inbox_older_than,
                                 published_older_than_ms=published_older_than, batch=batch, clock=SystemClock(),
                                 redelivery_window_ms=settings.broker_redelivery_window_ms, progress=step)
    if as_json:
        echo_json(report.to_dict())
        return
    click.echo(f"inbox: deleted {report.inbox_deleted} row(s) in {report.inbox_batches} batch(es)")
    click.echo(f"outbox: deleted {report.outbox_deleted} published row(s) in {report.outbox_batches} batch(es)")
    click.echo(f"summary: deleted {report.inbox_deleted + report.outbox_deleted} row(s) in "
               f"{report.inbox_batches + report.outbox_batches} batch(es), {time.monotonic() - started:.1f}s")


@dataclass(frozen=True, kw_only=True)
class Threshold:
    name: str
    limit: int
    value: int | None
    crossed: bool
    message: str  # what to tell the person when it is crossed

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "limit": self.limit, "value": self.value, "crossed": self.crossed}


def thresholds(st: ops_stats.Stats, *, fail_on_dead_letters: bool, max_pending_age_ms: int | None,
               max_overdue_ms: int | None = None, max_claim_held_ms: int | None = None) -> list[Threshold]:
    """The thresholds asked for, each with its value and whether it is crossed."""
    found: list[Threshold] = []
    if fail_on_dead_letters:
        found.append(Threshold(
            name="dead_letters", limit=0, value=st.dead_letter_total, crossed=st.dead_letter_total > 0,
            message=f"{st.dead_letter_total} unreplayed dead letter(s), oldest {_age(st.oldest_dead_letter_age_ms)} "
                    "(see 'outbox dead-letters list')"))
    if max_pending_age_ms is not None:
        age = st.oldest_pending_age_ms
        found.append(Threshold(
            name="max_pending_age_ms", limit=max_pending_age_ms, value=age,
            crossed=age is not None and age > max_pending_age_ms,
            message=f"the oldest pending outbox row is {_age(age)} old, over the limit of {_age(max_pending_age_ms)} "
                    "(relay down or broker unreachable?)"))
    if max_overdue_ms is not None:
        late = st.oldest_overdue_ms
        found.append(Threshold(
            name="max_overdue_ms", limit=max_overdue_ms, value=late,
            crossed=late is not None and late > max_overdue_ms,
            message=f"a pending outbox row has been due for {_age(late)} and no relay has published it, over the "
                    f"limit of {_age(max_overdue_ms)} (every relay stopped or stuck? rows backing off are not counted)"))
    if max_claim_held_ms is not None:
        held = st.claim_held_ms
        found.append(Threshold(
            name="max_claim_held_ms", limit=max_claim_held_ms, value=held,
            crossed=held is not None and held > max_claim_held_ms,
            message=f"a relay has held its claimed rows for {_age(held)} without publishing and marking them, over "
                    f"the limit of {_age(max_claim_held_ms)} (a relay stopped or stuck mid-batch; other relays skip "
                    "its rows until Postgres ends its transaction)"))
    return found


@click.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--fail-on-dead-letters", is_flag=True,
              help=f"Exit {EXIT_PROBLEM} if any unreplayed dead letter exists (either store).")
@click.option("--max-pending-age", "max_pending_age_ms", type=Duration(), default=None,
              help=f"Exit {EXIT_PROBLEM} if the oldest pending outbox row is older than this (e.g. 5m).")
@click.option("--max-overdue", "max_overdue_ms", type=Duration(), default=None,
              help=f"Exit {EXIT_PROBLEM} if a pending row has been due for longer than this with no relay publishing "
                   "it (e.g. 1m); rows backing off after a failure are not due, so they never trip it.")
@click.option("--max-claim-held", "max_claim_held_ms", type=Duration(), default=None,
              help=f"Exit {EXIT_PROBLEM} if a relay has held claimed rows longer than this without marking them "
                   "(e.g. 30s; Postgres: a relay stopped or stuck mid-batch).")
@click.pass_context
@handle_errors
def stats(ctx: click.Context, as_json: bool, fail_on_dead_letters: bool, max_pending_age_ms: int | None,
          max_overdue_ms: int | None, max_claim_held_ms: int | None) -> None:
    """Pending count, oldest pending age, dead letters per source/consumer, inbox size, duplicates.
    With a threshold: exit 3 and one line per crossed threshold on stderr (see docs/operations.md, "Probes and exit codes")."""
    outbox = get_outbox(ctx)
    with _sessions(ctx)() as session:
        st = ops_stats.collect(session, tables=outbox.tables, clock=SystemClock())
    checks = thresholds(st, fail_on_dead_letters=fail_on_dead_letters, max_pending_age_ms=max_pending_age_ms,
                        max_overdue_ms=max_overdue_ms, max_claim_held_ms=max_claim_held_ms)
    if as_json:
        data = st.to_dict()
        if checks:
            data["thresholds"] = [c.to_dict() for c in checks]
        echo_json(data)
    else:
        _print_stats(outbox.known_consumers(), st)
    crossed = [c for c in checks if c.crossed]
    for c in crossed:
        click.echo(f"threshold crossed: {c.message}", err=True)
    if crossed:
        raise click.exceptions.Exit(EXIT_PROBLEM)


def _print_stats(known_consumers: tuple[str, ...], st: ops_stats.Stats) -> None:
    console = _console()
    outbox_t = _table("outbox", ("pending", "due", "retrying", "oldest pending", "due unpublished for",
                                 "relay claim held", "published (retained)"))
    outbox_t.add_row(str(st.pending), str(st.due), str(st.retrying), _age(st.oldest_pending_age_ms),
                     _age(st.oldest_overdue_ms), _age(st.claim_held_ms), str(st.published))
    console.print(outbox_t)
    # Held for a later eta (docs/scheduled.md): apart from the backlog figures above.
    console.print(f"scheduled: {st.scheduled}" + ("" if st.next_due_at_ms is None else
                  f", next due at {_utc(st.next_due_at_ms)} (in {_age(st.next_due_at_ms - st.now_ms)})"))
    # Held by the relay for a worker that runs them (a rolling deploy; docs/scheduled.md "Deploys").
    for w in st.waiting_for_worker:
        console.print(f"waiting for a worker that runs {w.what}: {w.count} (oldest {_age(w.oldest_age_ms)})")
    re_t = _table("re-sent by the reconciler (never arrived)",
                  ("total", "events (per consumer)", "@outbox.task", "plain tasks"))
    r = st.reconciled
    re_t.add_row(str(r["total"]), str(r["events"]), str(r["tasks"]), str(r["plain_tasks"]))
    console.print(re_t)
    dead_t = _table(f"dead letters: {st.dead_letter_total}", ("source", "consumer", "count", "oldest"))
    for g in st.dead_letters:
        dead_t.add_row(g.source, g.consumer or "-", str(g.count), _age(g.oldest_age_ms))
    console.print(dead_t)
    cons_t = _table("consumers", ("consumer", "inbox rows", "duplicates absorbed", "batches (mean size)"))
    batches = st.batches
    for name in sorted(set(st.inbox) | set(st.duplicates_absorbed) | set(known_consumers)):
        b = batches.get(name)
        cons_t.add_row(name, str(st.inbox.get(name, 0)), str(st.duplicates_absorbed.get(name, 0)),
                       f"{int(b['batches'])} ({b['mean_size']:g})" if b else "-")
    console.print(cons_t)
    if st.vacuum is not None:
        _print_vacuum(console, st.vacuum, st.now_ms)
    if st.partitions is not None:  # the partitioned layout (docs/partitioning.md, "Partitions ahead")
        h = st.partitions
        console.print(f"partitions ahead: {h.ahead:.2f} ({h.rows} rows before a write fails for want of a partition; "
                      f"the prune keeps --ahead of them)")


def _print_vacuum(console: Console, v: ops_stats.VacuumStats, now_ms: int) -> None:
    """Postgres: what predicts a bloated outbox (docs/operations.md, "Vacuum and bloat")."""
    if v.oldest_xact_age_xids is None:
        console.print("vacuum horizon: no open transaction holds it back")
    else:
        console.print(f"vacuum horizon: oldest transaction holding it back is {v.oldest_xact_age_xids} xids old "
                      f"({v.oldest_xact}); longest open {_age(v.oldest_xact_age_ms)}")
    for slot in v.slots:
        console.print(f"replication slot {slot.slot} ({'active' if slot.active else 'INACTIVE'}): xmin "
                      f"{'-' if slot.xmin_age_xids is None else slot.xmin_age_xids} xids, catalog_xmin "
                      f"{'-' if slot.catalog_xmin_age_xids is None else slot.catalog_xmin_age_xids} xids old")
    vac_t = _table("dead tuples (pg_stat_user_tables, estimates)", ("table", "dead", "live", "last autovacuum", "last vacuum"))
    def ago(at_ms: int | None) -> str:
        return "never" if at_ms is None else f"{_age(max(0, now_ms - at_ms))} ago"

    for t in v.tables:
        vac_t.add_row(t.table, str(t.dead_tuples), str(t.live_tuples), ago(t.last_autovacuum_ms), ago(t.last_vacuum_ms))
    console.print(vac_t)
