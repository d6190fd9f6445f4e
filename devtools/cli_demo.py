"""``python -m devtools demo``: the main job on the embedded default."""

from __future__ import annotations

import sys

import click

from celery_outbox.cli.common import handle_errors
from devtools.settings import deployment_settings as get_settings


@click.command()
@click.option("--orders", type=click.IntRange(1, 100_000), default=100, show_default=True,
              help="How many orders to place.")
@click.option("--duplicates", type=click.IntRange(0, 1000), default=5, show_default=True,
              help="How many events to publish twice on purpose (relay crash after publish).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(1, 3600), default=180.0, show_default=True,
              help="Seconds to wait for the pipeline to settle.")
@click.option("--keep/--fresh", default=False, help="Keep the demo database of an earlier run.")
@click.pass_context
@handle_errors
def demo(ctx: click.Context, orders: int, duplicates: int, timeout_s: float, keep: bool) -> None:
    """Run orders -> outbox -> relay -> Shipping/Billing/Search/Email end to end, and check every count."""
    from devtools.demo import run_demo

    settings = get_settings(ctx)
    duplicates = min(duplicates, orders)
    try:
        result = run_demo(settings=settings, orders=orders, duplicates=duplicates, timeout_s=timeout_s,
                          fresh=not keep)
    except KeyboardInterrupt:
        click.echo("interrupted; every process was stopped", err=True)
        sys.exit(130)
    sys.exit(0 if result.ok else 1)
