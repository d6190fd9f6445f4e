"""``python -m devtools embedded-redis``: the embedded default broker's lifecycle."""

from __future__ import annotations

import click

from celery_outbox.cli.common import handle_errors
from devtools.settings import deployment_settings as get_settings
from relay.embedded import EmbeddedRedis


@click.group("embedded-redis")
def embedded_redis() -> None:
    """Start or stop the embedded Redis broker (the default when OUTBOX_BROKER_URL is unset)."""


@embedded_redis.command()
@click.pass_context
@handle_errors
def start(ctx: click.Context) -> None:
    """Start it (or find it running) and print its URL."""
    click.echo(EmbeddedRedis(data_dir=get_settings(ctx).home / "redis").ensure())


@embedded_redis.command()
@click.pass_context
@handle_errors
def stop(ctx: click.Context) -> None:
    """Stop it."""
    stopped = EmbeddedRedis(data_dir=get_settings(ctx).home / "redis").stop()
    click.echo("stopped" if stopped else "not running")
