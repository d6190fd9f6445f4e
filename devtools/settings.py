"""The deployment settings for devtools commands: read once per invocation, bad config exits 2."""

from __future__ import annotations

import click

from celery_outbox import ConfigError
from celeryconfig import Settings


class BadConfiguration(click.ClickException):
    """``Error: bad configuration: ...``: one line on stderr, exit status 2 (like the ``outbox`` CLI)."""

    exit_code = 2


def deployment_settings(ctx: click.Context) -> Settings:
    root = ctx.find_root()
    root.ensure_object(dict)
    if "settings" not in root.obj:
        try:
            root.obj["settings"] = Settings.from_env()
        except ConfigError as e:
            raise BadConfiguration(f"bad configuration: {' '.join(str(e).split())}") from None
    settings: Settings = root.obj["settings"]
    return settings
