"""``flask outbox ...``: the ``outbox`` command's commands, as a Flask CLI group on the app's ``Outbox``."""

from __future__ import annotations

from collections.abc import Callable

import click

from celery_outbox.outbox import Outbox


def flask_cli(current_outbox: Callable[[], Outbox]) -> click.Group:
    """``flask outbox ...``: the ``outbox`` command's commands on ``current_outbox()``, asked inside the
    app context (the extension passes the current app's ``Outbox``)."""
    from flask.cli import with_appcontext

    from celery_outbox.cli import cli as outbox_cli
    from celery_outbox.cli.common import OutboxGroup

    @click.group(cls=OutboxGroup, help="The transactional outbox of this app (same commands as `outbox`).")
    @with_appcontext
    @click.pass_context
    def group(ctx: click.Context) -> None:
        ctx.obj = {"outbox": current_outbox()}

    for command in outbox_cli.commands.values():
        group.add_command(command)
    return group
