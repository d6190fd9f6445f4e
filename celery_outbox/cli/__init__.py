"""The ``outbox`` command. Each concept's commands live in their own module of this package."""

from __future__ import annotations

import sys

from celery_outbox.cli.common import settings_group
from celery_outbox.cli.db import db
from celery_outbox.cli.ops import dead_letters, prune, stats
from celery_outbox.cli.probes import check
from celery_outbox.cli.relay import relay
from celery_outbox.cli.trace import trace


@settings_group
def cli() -> None:
    """Transactional outbox, inbox and idempotent consumers on Celery."""


cli.add_command(check)
cli.add_command(db)
cli.add_command(dead_letters)
cli.add_command(prune)
cli.add_command(stats)
cli.add_command(relay)
cli.add_command(trace)


def main() -> None:
    sys.exit(cli.main(prog_name="outbox", standalone_mode=True))
