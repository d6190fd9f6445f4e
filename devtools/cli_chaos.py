"""``python -m devtools chaos``: provoke every failure of the matrix against real Postgres and a real broker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from celery_outbox.cli.common import handle_errors

if TYPE_CHECKING:
    from chaos.harness import ChaosReport


def report_json(report: ChaosReport) -> dict[str, Any]:
    """The ``--json`` report: the run's counts, the failure matrix and the figures per fault."""
    from chaos import figures  # the harness is not in the deployment image: imported only by the chaos command

    assert report.invariants is not None
    return {
        "ok": report.ok, "broker": report.broker, "seed": report.seed, "orders": report.orders,
        "relay": report.relay_mode, "kills": dict(report.kills), "beat_kills": report.beat_kills,
        "db_freeze": {"seconds": round(report.db_freeze_s, 1), "connections": report.db_freeze_connections},
        "armed_not_reached": report.armed_not_reached,
        "taken_and_lost": [{"delivery": m.delivery, "message_id": m.message_id} for m in report.taken_and_lost],
        "consumers_stop": {"seconds": round(report.consumers_stop_s, 1),
                           "peak_queued": report.consumers_stop_peak_queued},
        "resent": [{"delivery": m.delivery, "message_id": m.message_id} for m in report.resent],
        "resent_not_lost": len(report.resent_not_lost),
        "email_provider_calls": report.email_provider_calls,
        "reconciled": {"all": report.invariants.snapshot.reconciled,
                       "events": report.invariants.snapshot.reconciled_events,
                       "tasks": report.invariants.snapshot.reconciled_tasks},
        "batches": {c: {"batches": n, "messages": report.invariants.snapshot.batched_messages.get(c, 0)}
                    for c, n in report.invariants.snapshot.batches.items()},
        "unexpected_exits": report.unexpected_exits, "duration_s": round(report.duration_s, 1),
        "violations": [{"invariant": v.invariant, "detail": v.detail} for v in report.invariants.violations],
        "matrix": [row.__dict__ for row in report.matrix], "figures": figures.to_json(report.figures),
        "workdir": report.workdir,
    }


@click.command("chaos")
@click.option("--orders", type=click.IntRange(min=1), default=200, show_default=True, help="Orders to place.")
@click.option("--kills", type=click.IntRange(min=0), default=12, show_default=True,
              help="SIGKILLs of relay, worker and order-writer processes at named crash points.")
@click.option("--broker", type=click.Choice(["redis", "rabbitmq"]), default="redis", show_default=True,
              help="redis: an own redis-server, killed and restarted; rabbitmq: the shared server behind a "
                   "loopback proxy that is cut and restored.")
@click.option("--relay", type=click.Choice(["standalone", "beat"]), default="standalone", show_default=True,
              help="standalone: `outbox relay` processes; beat: `celery beat` drives the relay tasks on relay-queue "
                   "workers, and beat itself is SIGKILLed at random moments.")
@click.option("--takes", type=click.IntRange(min=0), default=None,
              help="Take-window rounds, each removing one e-mail task and one event from the broker after their "
                   "rows were marked published (default: one per 100 orders, at least one).")
@click.option("--db-freeze", "db_freeze_s", type=click.FloatRange(min=0), default=3.0, show_default=True,
              help="Seconds the processes' connections to Postgres stall once mid-run (a loopback proxy stops "
                   "forwarding, connections kept); 0: no freeze, no proxy.")
@click.option("--outage", "outage_s", type=click.FloatRange(min=0.5), default=3.0, show_default=True,
              help="Seconds the broker stays down once, at half the order stream (Redis: killed and restarted; "
                   "RabbitMQ: the proxy cut).")
@click.option("--consumers-stop", "consumers_stop_s", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Seconds every consumer worker is stopped (SIGSTOP, connections kept) once, from a fifth of the "
                   "order stream, while orders keep coming; 0: never.")
@click.option("--orders-per-s", "orders_per_s", type=click.FloatRange(min=0.1), default=None,
              help="The order writer's rate (default: the stream lasts long enough for the kill plan).")
@click.option("--seed", type=int, default=0, show_default=True, help="Reproduces the run's plan.")
@click.option("--pg-admin-url", default=None, help="Postgres URL allowed to CREATE/DROP DATABASE "
              "(default OUTBOX_TEST_PG_ADMIN_URL or postgresql://postgres@127.0.0.1:5432/postgres).")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where logs go (default: a new temporary directory).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=10), default=240.0, show_default=True,
              help="Seconds the run may take before it is reported as not quiescent.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of a table.")
@click.option("--markdown", "markdown", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the loss and duplicate figures per fault to this file, as markdown, with the "
                   "command that produced them.")
@handle_errors
def chaos(orders: int, kills: int, broker: str, relay: str, takes: int | None, db_freeze_s: float,
          outage_s: float, consumers_stop_s: float, orders_per_s: float | None, seed: int, pg_admin_url: str | None,
          workdir: Path | None, timeout_s: float, as_json: bool, markdown: Path | None) -> None:
    """Kill processes at crash points, cut the broker, freeze the database, inject poison and duplicates,
    lose messages in the take window; check invariants.

    Exits 1 if any invariant is violated (or the run never became quiescent).
    """
    from rich.console import Console

    from chaos.environment import PG_ADMIN_URL
    from chaos.figures import render as render_figures
    from chaos.figures import to_markdown
    from chaos.harness import run_chaos
    from chaos.matrix import render

    console = Console(stderr=as_json)
    if not console.is_terminal:
        console = Console(stderr=as_json, width=160)
    if markdown is not None:  # fail now on a path that cannot be written, not after the run
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.touch()
    report = run_chaos(orders=orders, kills=kills, broker=broker, seed=seed, workdir=workdir,
                       pg_admin_url=pg_admin_url or PG_ADMIN_URL, timeout_s=timeout_s,
                       relay=relay, takes=takes, db_freeze_s=db_freeze_s, outage_s=outage_s,
                       consumers_stop_s=consumers_stop_s,
                       orders_per_s=orders_per_s, progress=lambda msg: console.print(f"[dim]{msg}[/dim]", highlight=False))
    assert report.invariants is not None
    if markdown is not None:
        command = (f"python -m devtools chaos --orders {orders} --kills {kills} --broker {broker} --relay {relay} "
                   f"--seed {seed}" + (f" --takes {takes}" if takes is not None else "")
                   + (f" --db-freeze {db_freeze_s:g}" if db_freeze_s != 3.0 else "")
                   + (f" --outage {outage_s:g}" if outage_s != 3.0 else "")
                   + (f" --consumers-stop {consumers_stop_s:g}" if consumers_stop_s else "")
                   + (f" --orders-per-s {orders_per_s:g}" if orders_per_s else "")
                   + (f" --timeout {timeout_s:g}" if timeout_s != 240.0 else "") + f" --markdown {markdown}")
        verdict = "every invariant held" if report.ok else "INVARIANTS VIOLATED"
        markdown.write_text(to_markdown(report.figures, command=command,
                                        title=f"{broker}, relay {relay}, seed {seed}: {orders} orders, "
                                              f"{sum(report.kills.values())}/{kills} kills, "
                                              f"{report.duration_s:.1f} s, {verdict}"))
    if as_json:
        click.echo(json.dumps(report_json(report), indent=2))
    else:
        console.print(render(report.matrix, title=f"failure matrix: {broker}, relay {relay}, seed {seed}, "
                                                  f"{orders} orders, {sum(report.kills.values())}/{kills} kills, "
                                                  f"{len(report.taken_and_lost)} taken and lost"))
        console.print(render_figures(report.figures, title="loss and duplicates per fault"))
        snap = report.invariants.snapshot
        for c, n in snap.batches.items():
            console.print(f"batch consumer {c}: {snap.batched_messages.get(c, 0)} messages in {n} batches "
                          f"(mean {snap.batched_messages.get(c, 0) / n:.1f})")
        if report.armed_not_reached:
            console.print(f"armed but never reached (no traffic left): {', '.join(report.armed_not_reached)}")
        for exit_ in report.unexpected_exits:
            console.print(f"[red]unexpected: {exit_}[/red]")
        for v in report.invariants.violations:
            console.print(f"[red]violated: {v.invariant}: {v.detail}[/red]")
        if markdown is not None:
            console.print(f"figures per fault: {markdown}")
        console.print(f"logs: {report.workdir}/logs; {report.duration_s:.1f}s")
    if not report.ok:
        raise SystemExit(1)
    if not as_json:
        console.print("[green]all invariants hold[/green]")
