"""``outbox relay``: the standalone relay loop (or ``--once``: drain and exit)."""

from __future__ import annotations

import dataclasses
import logging

import click

from celery_outbox import migrate
from celery_outbox.celery import relay_tasks
from celery_outbox.cli.common import (
    AsciiInt,
    AsciiSeconds,
    BadInput,
    get_outbox,
    handle_errors,
    one_line,
    shown,
    upgrade_hint,
)
from celery_outbox.errors import ConfigError
from celery_outbox.outbox import Outbox
from celery_outbox.settings import Settings

# The setting each option stands for: its value is judged by that setting's own rule (celery_outbox/settings.py).
FLAGS = {"relay_batch_size": "--batch-size", "relay_max_in_flight_rows": "--max-in-flight",
         "relay_poll_interval_s": "--poll-interval", "relay_confirm_mode": "--confirm-mode"}


def with_options(settings: Settings, changes: dict[str, object], given: tuple[str, ...]) -> Settings:
    """``settings`` with the options' values, each judged by its setting's rule and the settings' relations, a
    refusal naming the option (exit 2), not the ``OUTBOX_*`` variable nobody set."""
    for name in given:
        problem = settings.RULES[name].problem(changes[name], settings)
        if problem:
            raise BadInput(f"Invalid value for '{FLAGS[name]}': {shown(changes[name])} {problem}")
    try:
        return dataclasses.replace(settings, **changes)  # type: ignore[arg-type]
    except ConfigError as e:
        raise BadInput(f"{', '.join(FLAGS[n] for n in given)} with the settings: {one_line(str(e))}") from None


def require_tables(outbox: Outbox) -> None:
    """A database that answers but has no outbox tables is a setup step not done: one line naming the command that
    makes them, exit 1, instead of a relay logging a traceback at every poll until someone reads it. A database
    that does not answer is left to the loop, which waits for it and goes on (a blip must not stop a relay)."""
    url, prefix = outbox.sessions.url, outbox.settings.table_prefix
    try:
        missing = migrate.current(url, prefix=prefix) is None and not migrate.tables_present(url, prefix=prefix)
    except Exception:
        return
    if missing:
        raise click.ClickException(upgrade_hint())


@click.command("relay")
@click.option("--once", is_flag=True, help="Drain every due row, then exit (exit 1 if the broker is down).")
@click.option("--batch-size", type=AsciiInt(low=1), default=None,
              help="First and smallest batch (default OUTBOX_RELAY_BATCH_SIZE).")
@click.option("--max-in-flight", type=AsciiInt(low=1), default=None,
              help="Largest batch: rows published but not yet marked (default OUTBOX_RELAY_MAX_IN_FLIGHT_ROWS).")
@click.option("--poll-interval", type=AsciiSeconds(low=0.001), default=None,
              help="Seconds between polls when no NOTIFY arrives (default OUTBOX_RELAY_POLL_INTERVAL_S).")
@click.option("--no-listen", is_flag=True, help="Do not LISTEN for Postgres NOTIFY; poll only.")
@click.option("--confirm-mode", type=click.Choice(["confirm", "tx", "none"]), default=None,
              help="RabbitMQ durability per batch (default OUTBOX_RELAY_CONFIRM_MODE).")
@click.pass_context
@handle_errors
def relay(ctx: click.Context, once: bool, batch_size: int | None, max_in_flight: int | None,
          poll_interval: float | None, no_listen: bool, confirm_mode: str | None) -> None:
    """Publish pending outbox rows to the broker: publish first, mark after."""
    outbox = get_outbox(ctx)
    changes: dict[str, object] = {}
    if batch_size is not None:
        changes["relay_batch_size"] = batch_size
        # A larger first batch raises the ceiling with it unless one was given (the batch never exceeds it).
        if max_in_flight is None:
            changes["relay_max_in_flight_rows"] = max(batch_size, outbox.settings.relay_max_in_flight_rows)
    if max_in_flight is not None:
        changes["relay_max_in_flight_rows"] = max_in_flight
    if poll_interval is not None:
        changes["relay_poll_interval_s"] = poll_interval
    if confirm_mode is not None:
        changes["relay_confirm_mode"] = confirm_mode
    if changes:
        given = tuple(name for name, value in (("relay_batch_size", batch_size), ("relay_max_in_flight_rows", max_in_flight),
                                               ("relay_poll_interval_s", poll_interval), ("relay_confirm_mode", confirm_mode))
                      if value is not None)
        outbox.settings = with_options(outbox.settings, changes, given)
    require_tables(outbox)  # before the log handler: alembic's INFO lines are no relay log
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loop = outbox.relay_loop(listen=not no_listen)
    loop.on_drain = relay_tasks.drain_announcer(outbox.app)  # its dead letters as Celery events (Flower)
    try:
        if once:
            result = loop.drain_once()
            click.echo(f"published {result.published}, failed {result.failed}, "
                       f"dead-lettered {result.dead_lettered} in {result.batches} batch(es)")
            if result.broker_unavailable:
                raise click.ClickException(f"stopped early: {result.error}")
        else:
            loop.run()
    finally:
        loop.close()
        if not loop.stats.abandoned:  # a loop thread still blocked may be using the publisher: leave it to exit
            loop.publisher.close()
