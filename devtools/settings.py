"""The deployment settings for devtools commands: read once per invocation, bad config exits 2."""

from __future__ import annotations

import click

from celery_outbox import ConfigError
from celeryconfig import Settings


def deployment_settings(ctx: click.Context) -> Settings:
    root = ctx.find_root()
    root.ensure_object(dict)
    if "settings" not in root.obj:
        try:
            root.obj["settings"] = Settings.from_env()
        except ConfigError as e:
            raise click.UsageError(f"bad configuration: {e}") from None
    settings: Settings = root.obj["settings"]
    return settings
