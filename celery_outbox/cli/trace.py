"""``outbox trace <message_id | key>``: one message's story, for a person (text) or a machine (``--json``)."""

from __future__ import annotations

import datetime as dt
import sys

import click
from rich.console import Console
from rich.table import Table

from celery_outbox.cli.common import AsciiInt, Checked, SafeConsole, echo_json, get_outbox, handle_errors
from celery_outbox.ops import trace as ops_trace


def _at(ms: int | None) -> str:
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _dur(ms: int | None) -> str:
    if ms is None:
        return "-"
    return f"{ms} ms" if abs(ms) < 10_000 else f"{ms / 1000:.1f} s"


def render(t: ops_trace.MessageTrace, console: Console) -> None:
    """The human view: the outbox hop, then one line per consumer or task."""
    head = Table(show_header=False, title=f"message {t.message_id} ({t.kind}, {t.type or '?'}): {t.state}")
    head.add_column("field")
    head.add_column("value")
    head.add_row("entity key / correlation", f"{t.entity_key or '-'} / {t.correlation_id or '-'}")
    head.add_row("committed at", _at(t.created_at_ms))
    if t.published_at_ms is not None:
        head.add_row("published at", f"{_at(t.published_at_ms)} (+{_dur(t.publish_latency_ms)})")
    elif t.state in ("pending", "retrying"):
        head.add_row("next publish attempt", _at(t.next_attempt_at_ms))
    head.add_row("failed publish attempts", str(t.publish_attempts_failed))
    if t.last_publish_error:
        head.add_row("last publish error", t.last_publish_error[:300])
    if t.dead_lettered_at_ms is not None:
        head.add_row("relay dead-lettered at", f"{_at(t.dead_lettered_at_ms)} (outbox:{t.seq})")
    console.print(head)
    hops = Table(title="consumers and tasks")
    for col in ("name", "kind", "state", "processed at", "after publish", "failed deliveries", "dead letters",
                "last error"):
        hops.add_column(col)
    for h in t.hops:
        dead = ", ".join(f"{d.id}" + (f" (replayed {_at(d.replayed_at_ms)})" if d.replayed_at_ms else "")
                         for d in h.dead_letters) or "-"
        error = h.last_error or (h.dead_letters[-1].error if h.dead_letters else "") or "-"
        hops.add_row(h.name, h.kind, h.state, _at(h.processed_at_ms), _dur(h.latency_ms), str(h.failed_deliveries),
                     dead, error[:120])
    if not t.hops:
        hops.add_row("(none routed)", "-", "-", "-", "-", "-", "-", "-")
    console.print(hops)


@click.command("trace")
@click.argument("key", type=Checked(name="key", check=ops_trace.check_key))
@click.option("--limit", type=AsciiInt(low=1), default=ops_trace.DEFAULT_LIMIT, show_default=True,
              help="At most this many messages for a key (the newest).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@handle_errors
def trace(ctx: click.Context, key: str, limit: int, as_json: bool) -> None:
    """One message's story: committed, published, and per consumer or task received, failed,
    dead-lettered, replayed, processed. KEY is a message id (task id), an entity key (order:42) or a
    correlation id."""
    outbox = get_outbox(ctx)
    with outbox.sessions()() as session:
        found = ops_trace.trace(session, key, tables=outbox.tables, routes=outbox.routes(),
                                idempotent_tasks=outbox.idempotent_tasks(), limit=limit)
    if as_json:
        echo_json([t.to_dict() for t in found])
        return
    console = SafeConsole(width=None if sys.stdout.isatty() else 200)
    for t in found:
        render(t, console)
    console.print("not recorded, so not shown: " + "; ".join(ops_trace.NOT_RECORDED))
