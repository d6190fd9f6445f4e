"""``outbox db``: schema migrations."""

from __future__ import annotations

import click

from outbox import migrate
from outbox.cli.common import get_settings, handle_errors


@click.group()
def db() -> None:
    """Database schema (Alembic migrations)."""


@db.command()
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@click.pass_context
@handle_errors
def upgrade(ctx: click.Context, revision: str) -> None:
    """Create or upgrade every table (orders, outbox, inbox, consumers)."""
    url = get_settings(ctx).effective_database_url
    migrate.upgrade(url, revision)
    click.echo(f"database at {migrate.current(url)} ({url.split('@')[-1]})")


@db.command()
@click.pass_context
@handle_errors
def current(ctx: click.Context) -> None:
    """Print the current schema revision."""
    click.echo(migrate.current(get_settings(ctx).effective_database_url) or "empty")
