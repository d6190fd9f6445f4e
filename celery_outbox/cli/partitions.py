"""``outbox db partitions ...``: the optional partitioned outbox layout (Postgres; docs/partitioning.md)."""

from __future__ import annotations

import click

from celery_outbox.cli.common import AsciiInt, Duration, echo_json, get_outbox, handle_errors
from celery_outbox.clock import SystemClock
from celery_outbox.ops import partitions as ops

_LOCK_TIMEOUT = click.option(
    "--lock-timeout", type=Duration(), default=f"{ops.DEFAULT_LOCK_TIMEOUT_MS}ms", show_default=True,
    help="Longest wait for the outbox table's lock; past it the command stops and changes nothing.")


@click.group("partitions")
def partitions() -> None:
    """Optional partitioned outbox table: retention drops old partitions instead of deleting rows."""


@partitions.command()
@click.option("--by", type=click.Choice(["seq"]), default="seq", show_default=True,
              help="The partition key: seq ranges (docs/partitioning.md says why not days).")
@click.option("--size", type=AsciiInt(low=1000, high=ops.MAX_SIZE), default=ops.DEFAULT_SIZE, show_default=True,
              help="Rows (seq values) per partition.")
@click.option("--ahead", type=AsciiInt(low=1, high=ops.MAX_AHEAD), default=ops.DEFAULT_AHEAD, show_default=True,
              help="Empty partitions to create above the next seq.")
@click.option("--reused-id-check/--no-reused-id-check", default=True, show_default=True,
              help="Refuse a message_id any partition holds (a probe per partition per insert), or per partition only.")
@_LOCK_TIMEOUT
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@handle_errors
def convert(ctx: click.Context, by: str, size: int, ahead: int, reused_id_check: bool, lock_timeout: int,
            as_json: bool) -> None:
    """Convert the live plain outbox table: it becomes the first partition (no row copied)."""
    outbox = get_outbox(ctx)
    report = ops.convert(outbox.sessions(), tables=outbox.tables, size=size, ahead=ahead,
                         lock_timeout_ms=lock_timeout, reused_id_check=reused_id_check)
    if as_json:
        echo_json(report.to_dict())
        return
    click.echo(f"{report.table}: partitioned by seq, {report.size} per partition; the old table holds seq < "
               f"{report.boundary}; created {', '.join(report.created)}")
    click.echo(f"validate scan {report.validate_s:.2f}s (writes went on), exclusive lock {report.lock_s * 1000:.0f} ms")


@partitions.command()
@click.option("--ahead", type=AsciiInt(low=1, high=ops.MAX_AHEAD), default=ops.DEFAULT_AHEAD, show_default=True,
              help="Empty partitions to keep above the next seq.")
@_LOCK_TIMEOUT
@click.pass_context
@handle_errors
def ensure(ctx: click.Context, ahead: int, lock_timeout: int) -> None:
    """Create partitions ahead of the next seq (`outbox prune` does it too)."""
    outbox = get_outbox(ctx)
    created = ops.ensure_partitions(outbox.sessions(), tables=outbox.tables, ahead=ahead, lock_timeout_ms=lock_timeout)
    click.echo(f"created {', '.join(created)}" if created else "enough partitions ahead; nothing created")


@partitions.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@handle_errors
def status(ctx: click.Context, as_json: bool) -> None:
    """Each partition: its seq range, rows, and what keeps it (pending, dead-lettered, recent rows)."""
    outbox = get_outbox(ctx)
    states = ops.status(outbox.sessions(), tables=outbox.tables)
    if as_json:
        echo_json([s.to_dict() for s in states])
        return
    for s in states:
        p = s.partition
        where = "default" if p.default else f"seq {p.lower if p.lower is not None else '-inf'}..{p.upper}"
        click.echo(f"{p.name}: {where}, {s.rows} row(s), pending {'yes' if s.pending else 'no'}, dead {s.dead}, "
                   f"newest published_at_ms {s.newest_published_ms}, {'closed' if s.closed else 'open'}")


@partitions.command()
@click.option("--published-older-than", type=Duration(), required=True,
              help="Drop partitions whose rows were all published longer ago than this.")
@click.option("--dead-older-than", type=Duration(), default=None,
              help="Also drop partitions holding dead-lettered rows older than this (default: keep them).")
@_LOCK_TIMEOUT
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@handle_errors
def drop(ctx: click.Context, published_older_than: int, dead_older_than: int | None, lock_timeout: int,
         as_json: bool) -> None:
    """Drop expired partitions (what `outbox prune --published-older-than` does on this layout)."""
    outbox = get_outbox(ctx)
    report = ops.drop_expired(outbox.sessions(), tables=outbox.tables, published_older_than_ms=published_older_than,
                              dead_older_than_ms=dead_older_than, clock=SystemClock(), lock_timeout_ms=lock_timeout)
    if as_json:
        echo_json(report.to_dict())
        return
    click.echo(f"dropped {len(report.dropped)} partition(s), {report.rows} row(s)"
               + (f": {', '.join(report.dropped)}" if report.dropped else ""))
    for name, why in report.kept.items():
        click.echo(f"kept {name}: {why}")


@partitions.command()
@click.option("--yes", is_flag=True, help="Confirm: the copy holds an exclusive lock on the outbox table.")
@_LOCK_TIMEOUT
@click.pass_context
@handle_errors
def revert(ctx: click.Context, yes: bool, lock_timeout: int) -> None:
    """Back to the plain table: copies every row under an exclusive lock (prune first)."""
    if not yes:
        raise click.UsageError("revert copies every outbox row while writes wait: prune first, then pass --yes")
    outbox = get_outbox(ctx)
    held = ops.revert(outbox.sessions(), tables=outbox.tables, lock_timeout_ms=lock_timeout)
    click.echo(f"{outbox.tables.table(outbox.tables.outbox).name}: plain table again; exclusive lock {held:.2f}s")
