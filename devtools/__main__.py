"""``python -m devtools demo|chaos|embedded-redis|db-upgrade``: the reference deployment's own tools."""

from __future__ import annotations

import sys

import click

from celery_outbox.cli.common import handle_errors
from devtools.cli_chaos import chaos
from devtools.cli_demo import demo
from devtools.cli_embedded import embedded_redis
from devtools.settings import deployment_settings
from devtools.settings_doc import settings_doc


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Tools of the reference deployment (not part of the installed library)."""


@cli.command("db-upgrade")
@click.pass_context
@handle_errors
def db_upgrade(ctx: click.Context) -> None:
    """Create or upgrade the library's tables and the Orders service's tables."""
    from orders import migrate

    url = deployment_settings(ctx).effective_database_url
    migrate.upgrade(url)
    click.echo(f"database upgraded ({url.split('@')[-1]})")


cli.add_command(chaos)
cli.add_command(demo)
cli.add_command(embedded_redis)
cli.add_command(settings_doc)

if __name__ == "__main__":
    sys.exit(cli.main(prog_name="python -m devtools", standalone_mode=True))
