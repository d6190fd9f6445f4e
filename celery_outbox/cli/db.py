"""``outbox db``: schema migrations."""

from __future__ import annotations

from typing import Any

import click
from sqlalchemy.engine import make_url

from celery_outbox import autovacuum, migrate
from celery_outbox.cli.common import DB_UPGRADE, BadInput, get_outbox, handle_errors, shown, upgrade_hint
from celery_outbox.cli.partitions import partitions


def _where(url: str) -> str:
    """The database for humans: driver, host and name, never the password."""
    return make_url(url).render_as_string(hide_password=True)


SYMBOLIC_REVISIONS = ("head", "heads", "base")


class Revision(click.ParamType):  # type: ignore[type-arg]
    """``head`` (``heads``), ``base`` or one of the library's revision ids, exactly: anything else (a typo, a
    relative step, a range) is refused before the database is opened, one line and exit 2."""

    name = "revision"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        known = migrate.revisions()
        if isinstance(value, str) and (value in SYMBOLIC_REVISIONS or value in known):
            return value
        self.fail(f"{shown(value)} is not a revision: {', '.join(SYMBOLIC_REVISIONS)} or one of {', '.join(known)}",
                  param, ctx)


@click.group()
def db() -> None:
    """Database schema (Alembic migrations)."""


db.add_command(partitions)  # the optional partitioned outbox layout: docs/partitioning.md


@db.command()
@click.option("--revision", type=Revision(), default="head", show_default=True, help="Target revision.")
@click.pass_context
@handle_errors
def upgrade(ctx: click.Context, revision: str) -> None:
    """Create or upgrade the library's tables (own version table; your tables are never touched)."""
    outbox = get_outbox(ctx)
    url, prefix = outbox.sessions.url, outbox.settings.table_prefix
    command = outbox.schema_command
    if command != DB_UPGRADE and migrate.current(url, prefix=prefix) != migrate.head():
        # Django's migrations own these tables: made here first, `manage.py migrate` fails on them (docs/django.md)
        raise BadInput(f"this project's outbox tables are created and upgraded by `{command}`, not `{DB_UPGRADE}` "
                       f"(tables made outside its migrations make `{command}` fail on a table that already exists): "
                       f"run `{command}`")
    migrate.upgrade(url, revision, prefix=prefix)
    click.echo(f"outbox tables at {migrate.current(url, prefix=prefix)} ({_where(url)})")


@db.command()
@click.option("--revision", type=Revision(), default="head", show_default=True, help="The revision to record.")
@click.pass_context
@handle_errors
def stamp(ctx: click.Context, revision: str) -> None:
    """Record the library's schema revision without migrating: for outbox tables your own migrations created
    (Alembic from define_tables, Django's migrate). Then `outbox db check` says whether they match."""
    outbox = get_outbox(ctx)
    url, prefix = outbox.sessions.url, outbox.settings.table_prefix
    migrate.stamp(url, revision, prefix=prefix)
    click.echo(f"outbox tables stamped at {migrate.current(url, prefix=prefix)} ({_where(url)})")


@db.command()
@click.pass_context
@handle_errors
def current(ctx: click.Context) -> None:
    """Print the current schema revision."""
    outbox = get_outbox(ctx)
    revision = migrate.current(outbox.sessions.url, prefix=outbox.settings.table_prefix)
    click.echo(revision or f"empty ({upgrade_hint()})")


@db.command()
@click.pass_context
@handle_errors
def check(ctx: click.Context) -> None:
    """Exit 1 unless the live schema matches this version of the library (for CI and readiness probes).
    On Postgres it also shows the hot tables' autovacuum settings and warns (exit unchanged) when they are
    missing or the server's autovacuum is off (docs/operations.md, "Vacuum and bloat")."""
    outbox = get_outbox(ctx)
    if migrate.current(outbox.sessions.url, prefix=outbox.settings.table_prefix) is None:
        if migrate.tables_present(outbox.sessions.url, prefix=outbox.settings.table_prefix):
            raise click.ClickException(
                f"the outbox tables exist but carry no library schema version "
                f"({outbox.tables.version_table} is missing: your own migrations created them?): run "
                "`outbox db upgrade` once; it keeps existing tables, records the version and adds its triggers "
                "(the relay's NOTIFY, the parked marker)")
        raise click.ClickException(upgrade_hint())  # one line, not a diff of every table
    problems = migrate.check(outbox.sessions.url, prefix=outbox.settings.table_prefix)
    for p in problems:
        click.echo(p, err=True)
    if not problems:
        click.echo("schema ok")
    _show_autovacuum(ctx)
    if problems:
        raise click.exceptions.Exit(1)


def _show_autovacuum(ctx: click.Context) -> None:
    """The hot tables' effective autovacuum settings: a warning, never a failed check (an operator may tune
    them on purpose, and readiness must not depend on them). Nothing on SQLite."""
    outbox = get_outbox(ctx)
    with outbox.sessions()() as session:
        report = autovacuum.inspect(session.connection(), outbox.tables)
    if report is None:
        return
    for line in report.lines():
        click.echo(line)
    for line in report.warnings():
        click.echo(line, err=True)
